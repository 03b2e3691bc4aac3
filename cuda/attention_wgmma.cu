// Fused causal attention on Hopper tensor cores: wgmma + TMA, bf16 and TF32 (sm_90a only).
//
//   flash_attention_forward_kernel4_bf16_persistent_overlap_pingpong_s4   attention_forward variant 4 (bf16):
//       out (B,T,C) = softmax(scale q k^T, causal) v, rounded to bf16 once;
//       lse (B,NH,T) = log sum_{s<=t} exp(scale q_t.k_s), fp32 (what the fused backward 2/3/4 reads)
//       (the variant's build; the lab's other schedules, the same bits: _kernel4_bf16 one CTA per
//       block, _pingpong, _overlap, _overlap_pingpong, and the persistent ones FWD_PERSISTENT lists)
//   flash_attention_backward_dq_kernel4_bf16[_btc[_pingpong]]     attention_backward variant 4 (bf16),
//       part 1: D (B,NH,T) = rowsum(dout * out) fp32 scratch; dq -> dinp[..., 0:C]
//   flash_attention_backward_dkdv_kernel4_bf16[_btc[_pingpong]]   part 2: dk, dv -> dinp[..., C:3C]
//       (reads D). _btc: q, k, v from the (B,T,3C) qkv tensor (the model's in-place form; with
//       _pingpong, its default), else from the permuted qkvr; the backward's design is below.
//       With a partials pointer (colsum form, dbias(3C) += dinp's column sums: qkv's bias gradient)
//       each warpgroup also sums the 64 rows it stores into a row of partials, which
//       flash_attention_backward_colsum_finish_kernel_bf16 adds into dbias (variant 5: the same, with
//       its convert pass as flash_attention_backward_convert_colsum_kernel5_bf16_rg{8,4})
//   flash_attention_forward_kernel4_tf32[_btc][_smt], flash_attention_backward_{dq,dkdv}_kernel4_tf32
//       [_btc][_smt]: variant 4's fp32 builds (TF32 wgmma; fp32 in and out), the same algorithms with
//       v (forward), k, q, dout (backward) transposed for TF32's K-major operands, either by
//       attention_vt_kernel in global memory or (_smt) in shared memory; the TF32 sections below.
//       Their colsum form: each warp sums the 16 rows it stores into a row of partials (one per 16 rows),
//       which flash_attention_backward_colsum_finish_kernel_fp32 adds into the fp32 dbias
//
// Build: nvcc -gencode=arch=compute_90a,code=sm_90a (llmc/runtime.py: ARCH_SPECIFIC).
// Lab:   python dev/cuda/attention_forward.py 4 --dtype bf16 (or fp32: the TF32 rows)
//        python dev/cuda/attention_backward.py --dtype bf16 --batch 16
// Tests: python -m pytest -m gpu tests/test_attention.py -k wgmma
//
// Why: variants 2/3 issue mma.sync m16n8k16, which on Hopper tops out near 60% of the tensor cores'
// rate (~100-110 TFLOP/s here). This is the FlashAttention-3 recipe written for this project: the
// products are warpgroup-wide wgmma, the k/v tiles come in by the TMA on an mbarrier pipeline fed by
// a producer warpgroup, and p goes from the fp32 score registers straight into the second product.
//
// The forward's CTA: a (b, h, block of 128 query rows), or, persistent (the default), one CTA per SM
// walking such blocks (see flash_forward_wgmma_persistent) with a 4-deep k/v ring; 3 warpgroups:
//   warpgroup 0      producer. One thread loads the block's q (128 x 64) once, then the k and v
//                    tiles (128 keys x 64 each) of key tiles 0..qb into a STAGES-deep ring, waiting
//                    on each stage's `empty` mbarrier; the TMA completes them on `full`. It gives
//                    its registers to the consumers (setmaxnreg.dec 24 / .inc 240).
//   warpgroups 1, 2  consumers, query rows 0-63 and 64-127 of the block. Per key tile:
//                      S (64 x 128 keys) = q k^T   4 x wgmma m64n128k16, q and k from shared memory
//                      online softmax on S in fp32 registers (mask only on the diagonal tile)
//                      O (64 x 64) += P V          8 x wgmma m64n64k16, P from registers, V from
//                                                  shared memory read transposed (N-major B)
//                    then release the stage (one arrival per consumer warp on `empty`).
// Grid (B*NH, ceil(T/128)): blockIdx.y counts down from the last query block, so the blocks with the
// most key tiles start first (the CUDA scheduler hands out blocks x-fastest, y-slowest).
// The two consumer warpgroups share the tensor cores. Left alone they run in lockstep (both wait on
// the same `full` barrier): both issue, then both compute their softmax while the tensor cores idle.
// The _pingpong builds make them take turns issuing (PingPong below), so one's softmax runs beside
// the other's products. The _overlap builds also overlap inside a warpgroup: tile i+1's q k^T is issued
// before tile i's p v (forward_block_overlap). A consumer then holds two stages at once, so overlap pays
// only with a ring deeper than 2: lab, H100, bf16, B=16, in place, one CTA per block with 2 stages
// 0.149 ms against 0.1385 without overlap; persistent with turns and 4 stages 0.1015 against 0.1115 for
// persistent with turns, 2 stages and no overlap (the default until 2026-11-26, session 17).
//
// Layouts (g = lane/4, t = lane%4, w = warp within the warpgroup):
// * Global: q, k, v are read through one of two tensor maps (the template flag BTC):
//   BTC = true: straight from the qkv matmul's output (B, T, 3C) (no permute; the model's default in
//     training with backward 4, which reads the same tensor): a 4D tensor (64 dims, 3*NH heads, T
//     rows, B), q of head h is head h, k head NH + h, v head 2*NH + h; boxes (64, 1, 128, 1).
//   BTC = false: from qkvr (3, B, NH, T, 64), the permuted copy that backward 2/3 read: a 3D tensor
//     (64 dims, T rows, 3*B*NH slabs), q of head bh is slab bh, k slab BNH+bh, v slab 2*BNH+bh;
//     boxes (64, 128, 1).
//   Either way a box is one head's 128 rows of 128 bytes, and rows past T are zero-filled by the TMA
//   (T not a multiple of 128, T = 1 included), never the next head's or batch row's.
// * Shared: every tile row is 64 bf16 = 128 bytes = one 128-byte swizzle span; row r at byte 128 r,
//   its 16-byte chunk c stored at chunk c ^ (r % 8) (CU_TENSOR_MAP_SWIZZLE_128B). Tiles are
//   1024-byte aligned (the swizzle's period), so a tile's 8-row groups are atoms 1024 bytes apart.
// * S = q k^T: both operands K-major (head dim contiguous), the GEMM engine's "kk" case: descriptor
//   layout type 1 (SW128), SBO = 1024 (next 8 rows), LBO unused (16); k16 step ks of the 64 dims is
//   +32 bytes on the start address inside the swizzled row. Consumer cw's 64 q rows start at
//   8 KB * cw (atom-aligned).
// * O += P V: V is B (K = keys, N = dims) stored with N contiguous: MN-major, the wgmma's
//   transpose bit (TB = 1). Canonical MN-major SW128: 8 k rows (keys) of 128 bytes (64 n) per
//   1024-byte atom, SBO = 1024 (next 8 keys), LBO = the next 64-wide n block (none: N = 64 is one
//   block). k16 step kk (keys 16kk..16kk+15) = two atoms = +2048 bytes on the start address.
// * Accumulators of m64nN (fp32): register 4j + 2h + c of warp w, lane l holds row 16w + g + 8h,
//   column 8j + 2t + c (j < N/8). For S, column = key within the tile.
// * P as wgmma's register A (m64nNk16, bf16): per k-step kk, 4 x b32 of two bf16 each (lower
//   column in the low half), mma.sync m16n8k16's A layout over the warp's 16 rows:
//   a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..), columns 16kk + ...
//   With S's accumulator layout, a_r of k-step kk is exactly S registers 8kk + 2r, 8kk + 2r + 1
//   (j = 2kk + r/2, h = r%2): p goes from the score registers to the A operand with no shuffle.
// * mbarrier parity: use i of a stage (i = tile / STAGES) waits `full` with parity i & 1; the
//   producer waits `empty` with parity (i & 1) ^ 1, which a fresh barrier reports complete, so the
//   first STAGES loads go straight out.
// * wgmma ordering: wgmma.fence before each batch (the accumulators / P registers were written by
//   ordinary instructions), commit_group after it, wait_group 0 before anything reads the results
//   or rewrites P, and only then the stage is released; keep_in_regs pins the reads after the wait.
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include "hopper.cuh"
#include "wgmma.cuh"

typedef __nv_bfloat16 bf16;

constexpr int HS = 64;                      // head size (every GPT-2 size)
constexpr int ROW_BYTES = HS * 2;           // one q/k/v row: 128 bytes = one swizzle span
constexpr int BQ = 128;                     // query rows per CTA: 2 consumer warpgroups x 64
constexpr int BKV = 128;                    // keys per k/v tile (= BQ: one diagonal tile per block)
constexpr int STAGES = 2;                   // k/v ring depth (the one-CTA-per-block kernels; the persistent ones: FWD_PERSISTENT)
constexpr int THREADS = 384;                // producer warpgroup + 2 consumer warpgroups
constexpr int CONSUMER_WARPS = 8;
constexpr int Q_BYTES = BQ * ROW_BYTES;     // 16 KB
constexpr int KV_BYTES = BKV * ROW_BYTES;   // 16 KB each of k and v
constexpr int STAGE_BYTES = 2 * KV_BYTES;   // k then v
// dynamic shared memory: 1 KB of alignment slack, q, the stages, the mbarriers (llmc/ops/attention.py
// keeps the same number: WGMMA_FWD_SMEM)
constexpr int FWD_SMEM = 1024 + Q_BYTES + STAGES * STAGE_BYTES + 8 * (1 + 2 * STAGES);
static_assert(BQ == BKV, "one diagonal tile per query block");
static_assert(FWD_SMEM <= 227 * 1024, "fits one SM's shared memory");

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

// ------------------------------------------------------------------------------------------------
// PTX helpers: cuda/hopper.cuh has the shared ones; the TMA loads and the warpgroup barrier are this file's


// 4D box at coordinates (c0 = dim, c1 = head, c2 = row, c3 = batch): a head's rows of a (B,T,C) tensor
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
                 ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2),
                 "r"(c3)
                 : "memory");
}

// the box at (c0 = dim, c1 = head, c2 = row, c3 = batch) of a (B,T,C) tensor = the box staged in shared
// memory (rows past the map's T not written), in the issuing thread's bulk group
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

// barrier over one consumer warpgroup's 128 threads (ids 1, 2; 0 is __syncthreads)
__device__ __forceinline__ void wg_barrier(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

// 3D box at coordinates (c0 = dim, c1 = row, c2 = slab), completing on `bar`
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
                 ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}



// One head's 128 rows of q (which = 0), k (1) or v (2) from row `row`, completing on `bar`: through the
// 4D map of the (B,T,3C) qkv tensor (BTC) or the 3D map of the permuted qkvr (see Layouts)
template <bool BTC>
__device__ __forceinline__ void tma_load_head(void* dst, const CUtensorMap* map, uint64_t* bar, int which, int row,
                                              int B, int NH, int b, int h) {
    if constexpr (BTC) tma_load_4d(dst, map, bar, 0, which * NH + h, row, b);
    else tma_load_3d(dst, map, bar, 0, row, (which * B + b) * NH + h);
}

// The producer's k/v ring (thread 0 of warpgroup 0; the forward and the bf16 dq kernel): key tiles 0..nkt-1
// of head (b, h) into the ST-deep ring (stage s: k at skv + s * STAGE_BYTES, v KV_BYTES after it), each
// once its stage is free. (The persistent forward's walk, ring slots running on across items, keeps its own
// loop: through this helper its SASS differs.)
template <bool BTC, int ST>
__device__ __forceinline__ void load_kv_tiles(unsigned char* skv, const CUtensorMap* tm, uint64_t* full,
                                              uint64_t* empty, int nkt, int B, int NH, int b, int h) {
    for (int i = 0; i < nkt; i++) {
        const int s = i % ST, use = i / ST;
        mbar_wait(&empty[s], (use & 1) ^ 1);
        mbar_expect_tx(&full[s], STAGE_BYTES);
        unsigned char* sk = skv + s * STAGE_BYTES;
        tma_load_head<BTC>(sk, tm, &full[s], 1, i * BKV, B, NH, b, h);             // k
        tma_load_head<BTC>(sk + KV_BYTES, tm, &full[s], 2, i * BKV, B, NH, b, h);  // v
    }
}

// Descriptors (cuda/hopper.cuh: wgmma_desc_sw128). K-major tile (q, k; dout, v in the backward's
// dout v^T): SBO 1024 (next 8 rows), LBO unused (16).
__device__ __forceinline__ uint64_t desc_k(const void* p) { return wgmma_desc_sw128(p, 16); }

// MN-major tile (v in P V; k, q, dout as the B of the backward's position products: keys or queries
// x 64 dims, 128-byte swizzled by row): SBO 1024 (next 8 rows), LBO = the next 64-wide block of n
// (there is none at N = 64; set to the tile size).
__device__ __forceinline__ uint64_t desc_mn(const void* p) { return wgmma_desc_sw128(p, KV_BYTES); }

__device__ __forceinline__ float ex2(float x) {  // 2^x; ex2.approx(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {  // lo in the low half (lower column)
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float unpack_lo(uint32_t w) { return __uint_as_float(w << 16); }          // its lower column
__device__ __forceinline__ float unpack_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }  // its upper one

// ------------------------------------------------------------------------------------------------
// the consumers' pieces

// S (64 x 128) = q k^T over the 64 dims: 4 k-steps of 16 (32 bytes of each swizzled row)
__device__ __forceinline__ void issue_s(float (&sc)[64], const unsigned char* sqw, const unsigned char* sk) {
#pragma unroll
    for (int ks = 0; ks < HS / 16; ks++) wgmma_bf16_n128<0, 0>(sc, desc_k(sqw + 32 * ks), desc_k(sk + 32 * ks), ks > 0);
}

// O (64 x 64) += P (64 x 128 keys) V (128 keys x 64): 8 k-steps of 16 keys, two atoms each
__device__ __forceinline__ void issue_pv(float (&o)[32], const uint32_t (&pa)[8][4], const unsigned char* sv) {
#pragma unroll
    for (int kk = 0; kk < BKV / 16; kk++) wgmma_bf16_rs_n64<1>(o, pa[kk], desc_mn(sv + kk * 2048), 1);
}

// The diagonal tile's all-masked quarter (ATT_DIAG_SKIP: 1 unless defined 0). In a 128 x 128 diagonal tile
// the 64 x 64 block of (queries 0..63 of the tile, keys 64..127) is all masked, for any T (a key >= T comes
// after every query too): P = 0 and dS = 0 there. The products that only add that block are left out:
// the forward's p v of consumer 0 (queries 0..63) over keys 0..63 only; in backward 5's main kernel, dv and
// dk of consumer 1 (keys 64..127) over queries 64..127 only, and consumer 0's dq of the tile over keys
// 0..63 only. What is left out adds exact zeros (acc + 0 = acc), so every output keeps its bits. Not left
// out: S and dP of that block, which the forward's consumer 0 and the backward's consumer 1 could form as
// m64n64 instead of m64n128. With a branch between the two shapes ptxas serialized every wgmma of the
// kernel, a wait after each (C7515 / C7520; forward +16-18%, backward 5's main kernel +40% in the lab,
// session 58), in every form of the branch tried: around the issue alone, or fence to wait in each arm,
// the half into its own registers. Branches between k-step counts of one shape, fence to wait in each
// arm of the backward's, keep the pipeline (tests/test_cuda_compile.py counts the waits in the SASS).
#ifndef ATT_DIAG_SKIP
#define ATT_DIAG_SKIP 1
#endif

// The consumer's index (0, 1) as a warp-uniform value (a shuffle from lane 0): the skip's branches depend on
// it, and on the per-thread wg - 1 ptxas took them for divergent paths and serialized every wgmma of the
// kernel (C7520). Without the skip: wg - 1 itself, as before.
__device__ __forceinline__ int uniform_cw(int cw) { return ATT_DIAG_SKIP ? __shfl_sync(0xffffffffu, cw, 0) : cw; }

// p v over keys 0..63 only (k-steps 0..3): the forward's diagonal tile for consumer 0
__device__ __forceinline__ void issue_pv_lo(float (&o)[32], const uint32_t (&pa)[8][4], const unsigned char* sv) {
#pragma unroll
    for (int kk = 0; kk < BKV / 32; kk++) wgmma_bf16_rs_n64<1>(o, pa[kk], desc_mn(sv + kk * 2048), 1);
}

// Causal masks of a score tile in the accumulator layout (register 4j + e: row half e >> 1, column
// 8j + 2t + (e & 1)), as passes of their own, run only on the tiles that need them: folded into the
// elementwise loops as a select, the compiler predicates them onto every tile (a compare or two and a
// select per score). A masked score becomes -inf: 2^fma(-inf, c, -x) = +0 for any finite x, the same
// bits as the p = 0 it replaces.
// Query-major (rows = queries, the forward and the dq kernels): key key0 + 8j + 2t + c > row
// row0 + 8hh  <=>  8j + c - 8hh > lim, with lim = row0 - key0 - 2t.
template <int NJ>
__device__ __forceinline__ void mask_scores(float (&sc)[4 * NJ], int lim) {
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (8 * j + (e & 1) - 8 * (e >> 1) > lim) sc[4 * j + e] = -INFINITY;
}
// Key-major (the backward's transposed tiles, rows = keys): query q0 + 8j + 2t + c < key key0 + 8hh,
// or query >= T (zero-filled rows)  <=>  8j + c + d < 8hh or 8j + c >= hi, with d = q0 + 2t - key0 and
// hi = T - q0 - 2t.
template <int NJ>
__device__ __forceinline__ void mask_scores_t(float (&sc)[4 * NJ], int d, int hi) {
#pragma unroll
    for (int j = 0; j < NJ; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (8 * j + (e & 1) + d < 8 * (e >> 1) || 8 * j + (e & 1) >= hi) sc[4 * j + e] = -INFINITY;
}

// Online softmax of one tile of scores, in place: sc <- p = 2^(scale log2e s - m) in fp32, the running
// max m (log2 units) and sum l updated, corr = the factor O must be rescaled by. Only the diagonal
// tile (the last) has keys > some row of the block; it also holds every key >= T (zero-filled),
// and those are > every row < T: masked too. key0: the tile's first key; row0: this thread's first row.
// The max is taken over the raw scores (scaling by c2 > 0 is monotonic: m is the same number as the max
// of the scaled scores), p = 2^fma(s, c2, -m), and the row max and sum are kept as 4 partial values
// each (no chain of 32 dependent instructions). Measured on the H100 (lab, bf16, B=4, the default
// schedule): 0.0293 ms against 0.0307 with a multiply, a subtract and one running max and sum.
__device__ __forceinline__ void softmax_tile(float (&sc)[64], float (&m)[2], float (&l)[2], float (&corr)[2],
                                             bool diag, int key0, int row0, int t, float c2) {
    // (mask_scores: folded into the loops below, the default forward took 0.1164 ms against 0.1122,
    // lab, bf16, B=16)
    if (diag) mask_scores<16>(sc, row0 - key0 - 2 * t);
    float mp[2][4];  // [row h][partial]: register 4j + 2h + c goes to partial 2 (j & 1) + c
#pragma unroll
    for (int hh = 0; hh < 2; hh++)
#pragma unroll
        for (int q = 0; q < 4; q++) mp[hh][q] = -INFINITY;
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) mp[e >> 1][(j & 1) * 2 + (e & 1)] = fmaxf(mp[e >> 1][(j & 1) * 2 + (e & 1)], sc[4 * j + e]);
    float mneg[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {  // the 4 lanes of a quad hold a row's 128 columns
        float mx = fmaxf(fmaxf(mp[hh][0], mp[hh][1]), fmaxf(mp[hh][2], mp[hh][3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(m[hh], mx * c2);
        // 0 on the first tile (m = -inf; key 0 is never masked), exactly 1 when the max holds
        corr[hh] = mx == m[hh] ? 1.0f : ex2(m[hh] - mx);
        m[hh] = mx;
        mneg[hh] = -mx;
    }
    // p in fp32; l sums the fp32 p (lse stays fp32-accurate; p v uses p rounded to bf16)
    float lp[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float p = ex2(fmaf(sc[4 * j + e], c2, mneg[e >> 1]));
            sc[4 * j + e] = p;
            lp[e >> 1][(j & 1) * 2 + (e & 1)] += p;
        }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) l[hh] = l[hh] * corr[hh] + ((lp[hh][0] + lp[hh][1]) + (lp[hh][2] + lp[hh][3]));
}

__device__ __forceinline__ void rescale_o(float (&o)[32], const float (&corr)[2]) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        o[4 * j + 0] *= corr[0]; o[4 * j + 1] *= corr[0];
        o[4 * j + 2] *= corr[1]; o[4 * j + 3] *= corr[1];
    }
}

// p (in sc) packed to bf16 as the A fragments of the 8 k-steps of P V: k-step kk, register r is sc
// 8kk + 2r, 8kk + 2r + 1 (see Layouts)
__device__ __forceinline__ void pack_p(uint32_t (&pa)[8][4], const float (&sc)[64]) {
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) pa[kk][r] = pack_bf16(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
}

// ------------------------------------------------------------------------------------------------
// the forward

// Ping-pong between the two consumer warpgroups (FlashAttention-3's inter-warpgroup schedule): they
// would otherwise wait on the same `full` barrier and run in lockstep, both issuing their products at
// once (the tensor cores serve them one after the other) and then both doing their softmax at once
// (the tensor cores idle). With PINGPONG each warpgroup issues its products of a step (a "turn") only
// after the other has issued its own, so one warpgroup's softmax runs beside the other's products.
// Two named barriers of 256 threads, PP_BAR + cw: a warpgroup syncs on its own before its turn and
// arrives on the other's after it. Consumer 1 arrives on consumer 0's once at the start (consumer 0
// goes first) and skips its arrival after its last turn, so each barrier sees as many arrivals as
// syncs (nkt + 1 turns each: S of tile 0, then S of tile i + 1 with p v of tile i, then the last p v).
constexpr int PP_BAR = 3;  // 3 and 4 (0 is __syncthreads; 1, 2 wg_barrier)
__device__ __forceinline__ void pp_sync(int cw) { asm volatile("bar.sync %0, 256;" ::"r"(PP_BAR + cw) : "memory"); }
__device__ __forceinline__ void pp_arrive(int cw) { asm volatile("bar.arrive %0, 256;" ::"r"(PP_BAR + cw) : "memory"); }
// The protocol for consumer cw (ON = false: no-ops). Both consumers must take the same number of turns.
template <bool ON>
struct PingPong {
    int cw;
    __device__ __forceinline__ void start() const { if (ON && cw == 1) pp_arrive(0); }  // consumer 0 goes first
    __device__ __forceinline__ void begin() const { if (ON) pp_sync(cw); }
    __device__ __forceinline__ void end(bool last) const { if (ON && !(last && cw == 1)) pp_arrive(1 - cw); }
};

// One query block's key tiles 0..nkt-1 in the plain loop (q k^T, softmax, p v, one tile at a time; with
// PINGPONG 2 nkt turns each: q k^T of a tile, then its p v): O, m, l accumulate. Tile i's stage is ring
// slot u0 + i (the persistent kernel's ring runs on across blocks). Once the last q k^T has completed,
// on_q_read() runs (the persistent kernel frees q's buffer there).
template <bool PINGPONG, int ST = STAGES, typename F>
__device__ __forceinline__ void forward_block_plain(float (&o)[32], float (&m)[2], float (&l)[2], const unsigned char* sqw,
                                                    unsigned char* skv, uint64_t* full, uint64_t* empty, int u0, int nkt,
                                                    int row0, int t, int lane, float c2, const PingPong<PINGPONG>& turn,
                                                    F on_q_read) {
    float sc[64];
    uint32_t pa[8][4];
    float corr[2];
    for (int i = 0; i < nkt; i++) {
        const int u = u0 + i;
        unsigned char* st = skv + (u % ST) * STAGE_BYTES;  // k, then v KV_BYTES after it
        mbar_wait(&full[u % ST], (u / ST) & 1);
        turn.begin();
        wgmma_fence();
        issue_s(sc, sqw, st);
        wgmma_commit();
        turn.end(false);
        wgmma_wait<0>();
        keep_in_regs(sc);
        if (i == nkt - 1) on_q_read();
        softmax_tile(sc, m, l, corr, i == nkt - 1, i * BKV, row0, t, c2);
        rescale_o(o, corr);
        pack_p(pa, sc);
        turn.begin();
        wgmma_fence();
        if (ATT_DIAG_SKIP && i == nkt - 1 && turn.cw == 0)  // (keys 64..127 of the diagonal tile: all masked)
            issue_pv_lo(o, pa, st + KV_BYTES);
        else
            issue_pv(o, pa, st + KV_BYTES);
        wgmma_commit();
        turn.end(i == nkt - 1);
        wgmma_wait<0>();  // also: the P registers may be reused only after this
        keep_in_regs(o);
        // both products have read the stage: release it to the producer (one arrival per warp)
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[u % ST]);
    }
}

// The same block with the next tile's q k^T issued before this tile's p v (FlashAttention-3's
// intra-warpgroup overlap): the softmax of tile i + 1 runs on the CUDA cores while the tensor cores do
// p v of tile i (wait_group 1: the older group, S, is done; p v may still run). O is rescaled by tile
// i + 1's correction only once p v of tile i has landed, and P i + 1 is packed only then (P i's
// registers are p v's operand). Per row the same operations in the same order as forward_block_plain:
// the same bits. With PINGPONG: nkt + 1 turns each, q k^T of tile 0, then q k^T of tile i + 1 with p v
// of tile i, then the last p v. A consumer holds two stages at once (tile i's v, tile i + 1's k), so the
// producer runs ahead only with a ring deeper than 2: lab, bf16, B=16, 2 stages 0.149 ms (one CTA per
// block), persistent 4 stages 0.1025 against the plain persistent ping-pong kernel's 0.1108.
// What the SASS does (session 56, docs/ops.md "The forward's wait for p v"): ptxas moves the
// wait_group 0 up to the start of the softmax's basic block (right after the diagonal mask), so each
// consumer waits for its p v before its softmax; the gain over the plain loop is the earlier issue of
// q k^T, and the softmax overlaps the other consumer's products only. Holding the wait after the
// exponentials (a branch between them ends ptxas's block: 66 MUFU.EX2 between the two waits instead of
// 0, the same bits) measured slower: B=16 0.0957 against 0.0932 ms, B=4 0.0297 against 0.0290 (the two
// consumers' softmaxes then collide on the MUFU and issue slots); without ping-pong, 0.0928 / 0.0304.
template <bool PINGPONG, int ST, typename F>
__device__ __forceinline__ void forward_block_overlap(float (&o)[32], float (&m)[2], float (&l)[2], const unsigned char* sqw,
                                                      unsigned char* skv, uint64_t* full, uint64_t* empty, int u0, int nkt,
                                                      int row0, int t, int lane, float c2, const PingPong<PINGPONG>& turn,
                                                      F on_q_read) {
    float sc[64];
    uint32_t pa[8][4];
    float corr[2];
    auto stage = [&](int i) { return skv + ((u0 + i) % ST) * STAGE_BYTES; };  // k, then v KV_BYTES after it
    auto wait_full = [&](int i) { mbar_wait(&full[(u0 + i) % ST], ((u0 + i) / ST) & 1); };
    auto release = [&](int i) { __syncwarp(); if (lane == 0) mbar_arrive(&empty[(u0 + i) % ST]); };
    wait_full(0);
    turn.begin();
    wgmma_fence();
    issue_s(sc, sqw, stage(0));
    wgmma_commit();
    turn.end(false);
    wgmma_wait<0>();
    keep_in_regs(sc);
    if (nkt == 1) on_q_read();
    softmax_tile(sc, m, l, corr, nkt == 1, 0, row0, t, c2);
    rescale_o(o, corr);
    pack_p(pa, sc);
    for (int i = 0; i + 1 < nkt; i++) {
        wait_full(i + 1);
        turn.begin();
        wgmma_fence();
        issue_s(sc, sqw, stage(i + 1));
        wgmma_commit();
        issue_pv(o, pa, stage(i) + KV_BYTES);
        wgmma_commit();
        turn.end(false);
        wgmma_wait<1>();
        keep_in_regs(sc);
        if (i + 2 == nkt) on_q_read();
        softmax_tile(sc, m, l, corr, i + 2 == nkt, (i + 1) * BKV, row0, t, c2);
        wgmma_wait<0>();
        keep_in_regs(o);
        release(i);
        rescale_o(o, corr);
        pack_p(pa, sc);
    }
    turn.begin();
    wgmma_fence();  // the last tile's p v (the diagonal tile: consumer 0's keys 64..127 all masked)
    if (ATT_DIAG_SKIP && turn.cw == 0)
        issue_pv_lo(o, pa, stage(nkt - 1) + KV_BYTES);
    else
        issue_pv(o, pa, stage(nkt - 1) + KV_BYTES);
    wgmma_commit();
    turn.end(true);
    wgmma_wait<0>();
    keep_in_regs(o);
    release(nkt - 1);
}

// out = O / l (bf16 or fp32), lse = (m + log2 l) ln 2, of this thread's two rows row0, row0 + 8
template <typename OUT>
__device__ __forceinline__ void forward_store(OUT* out, float* lse, const float (&o)[32], const float (&m)[2],
                                              const float (&l)[2], int row0, int t, int b, int h, int NH, int T) {
    const int C = NH * HS;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = row0 + 8 * hh;
        float lr = l[hh];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        if (row >= T) continue;
        const float inv = 1.0f / lr;
        OUT* dst = out + ((size_t)b * T + row) * C + h * HS + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float x = o[4 * j + 2 * hh] * inv, y = o[4 * j + 2 * hh + 1] * inv;
            if constexpr (sizeof(OUT) == 2)
                *reinterpret_cast<uint32_t*>(dst + 8 * j) = pack_bf16(x, y);
            else
                *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(x, y);
        }
        if (t == 0) lse[((size_t)b * NH + h) * T + row] = (m[hh] + __log2f(lr)) * LN2;
    }
}

// The persistent forward's store of out (ATT_O_TMA, 1 unless defined 0; 0: forward_store's direct 4-byte
// stores): this consumer's 64 rows x 64 dims go to shared memory (so: 8 KB, 128-byte swizzled: row r's
// 16-byte chunk j at chunk j ^ (r % 8), so the 8 rows of a warp's store instruction meet different banks),
// then out by one TMA store of the box (rows past T are outside the map: not written). The same values as
// forward_store (the same products, rounded once). so is written again only after the previous item's store
// has read it (wait_group.read by the thread that issued it, then the warpgroup's barrier); the CTA waits
// for the last store's reads before it exits. lse as forward_store.
#ifndef ATT_O_TMA
#define ATT_O_TMA 1
#endif
constexpr int O_STAGE_BYTES = 64 * ROW_BYTES;  // a consumer's staged rows of out
__device__ __forceinline__ void forward_store_tma(float* lse, const float (&o)[32], const float (&m)[2], const float (&l)[2],
                                                  int row0, int t, int b, int h, int NH, int T, unsigned char* so,
                                                  const CUtensorMap* tmo, int rowblk, int tid, int cw) {
    const int warp = tid >> 5, g = (tid & 31) >> 2;
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    wg_barrier(1 + cw);
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = row0 + 8 * hh, r = 16 * warp + g + 8 * hh;  // (r % 8 = g)
        float lr = l[hh];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        const float inv = 1.0f / lr;
        const uint32_t a0 = smem_u32(so) + r * ROW_BYTES + 4 * t;
#pragma unroll
        for (int j = 0; j < 8; j++)
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(a0 + ((j ^ g) << 4)),
                         "r"(pack_bf16(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv)) : "memory");
        if (t == 0 && row < T) lse[((size_t)b * NH + h) * T + row] = (m[hh] + __log2f(lr)) * LN2;
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // (generic stores, read by the TMA)
    wg_barrier(1 + cw);
    if (tid == 0) {
        tma_store_4d(tmo, so, 0, h, rowblk, b);
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
}

// tm: the 4D tensor map of inp (see Layouts: BTC), in global memory. OVERLAP: the scores of the next
// tile are issued before p v of this one (FlashAttention-3's intra-warpgroup overlap; see the loop);
// PINGPONG: the two consumers take turns issuing (above).
template <bool OVERLAP, bool PINGPONG = false>
__device__ __forceinline__ void flash_forward_wgmma(bf16* out, float* lse, const CUtensorMap* tm, int B, int NH, int T,
                                                    float scale) {
    extern __shared__ unsigned char smem_raw[];
    // tiles need 1024-byte alignment for the swizzle; the launcher asks for 1 KB extra
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    unsigned char* sq = smem;                 // q (128 x 64)
    unsigned char* skv = smem + Q_BYTES;      // stage s: k at skv + s * STAGE_BYTES, v KV_BYTES after it
    uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + Q_BYTES + STAGES * STAGE_BYTES);
    uint64_t* full = q_full + 1;
    uint64_t* empty = full + STAGES;

    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int qb = gridDim.y - 1 - blockIdx.y;  // the query blocks with the most key tiles first
    const int q0 = qb * BQ;
    const int nkt = qb + 1;                     // key tiles 0..qb; tile qb holds the diagonal

    if (threadIdx.x == 0) mbar_init_pipeline(q_full, full, empty, STAGES, CONSUMER_WARPS);
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (threadIdx.x == 0) {
            tensormap_acquire(tm);
            mbar_expect_tx(q_full, Q_BYTES);
            tma_load_head<true>(sq, tm, q_full, 0, q0, B, NH, b, h);  // q
            load_kv_tiles<true, STAGES>(skv, tm, full, empty, nkt, B, NH, b, h);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

    const int cw = uniform_cw(wg - 1);  // consumer: query rows 64 cw .. 64 cw + 63 of the block
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int row0 = q0 + 64 * cw + 16 * warp + g;  // this thread's rows: row0 (h = 0), row0 + 8 (h = 1)
    const float c2 = scale * LOG2E;                 // scores -> log2 units
    const unsigned char* sqw = sq + cw * 64 * ROW_BYTES;

    float o[32];
#pragma unroll
    for (int i = 0; i < 32; i++) o[i] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (log2 units), partial sum

    mbar_wait(q_full, 0);
    const PingPong<PINGPONG> turn{cw};
    turn.start();
    if constexpr (!OVERLAP)
        forward_block_plain(o, m, l, sqw, skv, full, empty, 0, nkt, row0, t, lane, c2, turn, [] {});
    else
        forward_block_overlap<PINGPONG, STAGES>(o, m, l, sqw, skv, full, empty, 0, nkt, row0, t, lane, c2, turn, [] {});

    forward_store(out, lse, o, m, l, row0, t, b, h, NH, T);
}

// The forward's entry points (bf16 and TF32, every schedule): NAME(out, lse, tm, B, NH, T, scale) runs
// FN<TARGS...> on the same arguments. DT: out's type (bf16, or float in the TF32 builds). tm: the bf16
// builds' 4D map of the (B,T,3C) qkv tensor the forward reads (see Layouts: BTC); the TF32 builds' array of
// maps (flash_forward_wgmma_tf32's maps)
#define FWD4_ENTRY(NAME, DT, FN, ...)                                                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                            \
    NAME(DT* out, float* lse, const CUtensorMap* tm, int B, int NH, int T, float scale) {               \
        LLMC_PDL_WAIT();                                                                                \
        FN<__VA_ARGS__>(out, lse, tm, B, NH, T, scale);                                                 \
    }
// flash_attention_forward_kernel4_bf16<SFX>: flash_forward_wgmma<OVERLAP[, PINGPONG]>
#define FWD4_BF16(SFX, ...)                                                                             \
    FWD4_ENTRY(flash_attention_forward_kernel4_bf16##SFX, bf16, flash_forward_wgmma, __VA_ARGS__)
FWD4_BF16(, false)
// the lab's overlap=True build (llmc/ops/attention.py); the same bits as the plain one
FWD4_BF16(_overlap, true)
// the lab's pingpong=True builds: the two consumers taking turns issuing, plain or with overlap; the
// same bits (measured on the H100, B=16: overlap + ping-pong 0.151 ms against the plain kernel's 0.136)
FWD4_BF16(_pingpong, false, true)
FWD4_BF16(_overlap_pingpong, true, true)

// The persistent forward: one CTA per SM walking (b, h, query block) work items, so the producer
// loads the next block's q and first k/v tiles while the consumers finish this one (no CTA start,
// barrier set-up and pipeline fill per block). Item w is query block nqb - 1 - w / (B NH) of head
// w % (B NH): the blocks with the most key tiles first; CTA c takes items in snake order (round r:
// c or G - 1 - c of the r-th G items, G = gridDim.x) so that the long and short blocks even out. q is
// double-buffered (q_full / q_empty per buffer, freed once a block's last q k^T has completed); the
// k/v ring runs on across blocks. The consumers run forward_block_plain or forward_block_overlap per
// block: the same bits.
// (+ 2 O_STAGE_BYTES up to 5 stages: the consumers' staged rows of out, forward_store_tma; the 6-stage
// build stores out directly: its ring and the staging would not fit)
__host__ __device__ constexpr bool fwd_o_staged(int st) { return st <= 5; }
constexpr int fwd_p_smem(int st) {
    return 1024 + 2 * Q_BYTES + st * STAGE_BYTES + (fwd_o_staged(st) ? 2 * O_STAGE_BYTES : 0) + 8 * (4 + 2 * st);
}  // ST stages
constexpr int FWD_P_SMEM = fwd_p_smem(STAGES);
static_assert(FWD_P_SMEM <= 227 * 1024 && fwd_p_smem(5) <= 227 * 1024 && fwd_p_smem(6) <= 227 * 1024,
              "fits one SM's shared memory");

__device__ __forceinline__ int persistent_item(int r) {  // this CTA's r-th item (or >= items: done)
    const int G = gridDim.x, c = (r & 1) ? G - 1 - blockIdx.x : blockIdx.x;
    return r * G + c;
}

template <bool PINGPONG, bool OVERLAP, int ST>
__device__ __forceinline__ void flash_forward_wgmma_persistent(bf16* out, float* lse, const CUtensorMap* tm, int B,
                                                               int NH, int T, float scale) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    unsigned char* sq = smem;                     // q buffers 0, 1 (128 x 64 each)
    unsigned char* skv = smem + 2 * Q_BYTES;      // stage s: k at skv + s * STAGE_BYTES, v KV_BYTES after it
    constexpr bool OT = ATT_O_TMA && fwd_o_staged(ST);  // out through shared memory and the TMA
    unsigned char* so = skv + ST * STAGE_BYTES;   // consumer cw's staged out rows at so + cw * O_STAGE_BYTES
    uint64_t* q_full = reinterpret_cast<uint64_t*>(so + (fwd_o_staged(ST) ? 2 * O_STAGE_BYTES : 0));  // [2]
    uint64_t* q_empty = q_full + 2;                                               // [2]
    uint64_t* full = q_empty + 2;
    uint64_t* empty = full + ST;
    const int BNH = B * NH, nqb = (T + BQ - 1) / BQ, items = BNH * nqb;

    if (threadIdx.x == 0) {
        // q_full[j]: the producer's expect_tx arrival; q_empty[j]: lane 0 of every consumer warp
        mbar_init(&q_full[1], 1);
        for (int j = 0; j < 2; j++) mbar_init(&q_empty[j], CONSUMER_WARPS);
        mbar_init_pipeline(&q_full[0], full, empty, ST, CONSUMER_WARPS);  // q_full[0], the ring, the fence
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (threadIdx.x == 0) {
            tensormap_acquire(tm);
            int u = 0;  // ring slot of the next k/v tile
            for (int r = 0;; r++) {
                const int w = persistent_item(r);
                if (w >= items) break;
                const int qb = nqb - 1 - w / BNH, bh = w % BNH, b = bh / NH, h = bh % NH, j = r & 1;
                mbar_wait(&q_empty[j], ((r >> 1) & 1) ^ 1);
                mbar_expect_tx(&q_full[j], Q_BYTES);
                tma_load_head<true>(sq + j * Q_BYTES, tm, &q_full[j], 0, qb * BQ, B, NH, b, h);  // q
                for (int i = 0; i <= qb; i++, u++) {
                    const int s = u % ST;
                    mbar_wait(&empty[s], ((u / ST) & 1) ^ 1);
                    mbar_expect_tx(&full[s], STAGE_BYTES);
                    unsigned char* sk = skv + s * STAGE_BYTES;
                    tma_load_head<true>(sk, tm, &full[s], 1, i * BKV, B, NH, b, h);             // k
                    tma_load_head<true>(sk + KV_BYTES, tm, &full[s], 2, i * BKV, B, NH, b, h);  // v
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

    const int cw = uniform_cw(wg - 1);  // consumer: query rows 64 cw .. 64 cw + 63 of each block
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const float c2 = scale * LOG2E;
    const PingPong<PINGPONG> turn{cw};
    if (OT && tid == 0) tensormap_acquire(tm + 1);  // (out's map, the TMA store's)
    int u = 0;
    for (int r = 0;; r++) {
        const int w = persistent_item(r);
        if (w >= items) break;
        const int qb = nqb - 1 - w / BNH, bh = w % BNH, b = bh / NH, h = bh % NH, j = r & 1;
        const int row0 = qb * BQ + 64 * cw + 16 * warp + g;
        float o[32];
#pragma unroll
        for (int i = 0; i < 32; i++) o[i] = 0.0f;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        mbar_wait(&q_full[j], (r >> 1) & 1);
        turn.start();
        auto q_read = [&] { __syncwarp(); if (lane == 0) mbar_arrive(&q_empty[j]); };
        if constexpr (OVERLAP)
            forward_block_overlap<PINGPONG, ST>(o, m, l, sq + j * Q_BYTES + cw * 64 * ROW_BYTES, skv, full, empty, u,
                                                      qb + 1, row0, t, lane, c2, turn, q_read);
        else
            forward_block_plain<PINGPONG, ST>(o, m, l, sq + j * Q_BYTES + cw * 64 * ROW_BYTES, skv, full, empty, u, qb + 1,
                                                    row0, t, lane, c2, turn, q_read);
        u += qb + 1;
        if (OT)
            forward_store_tma(lse, o, m, l, row0, t, b, h, NH, T, so + cw * O_STAGE_BYTES, tm + 1, qb * BQ + 64 * cw,
                              tid, cw);
        else
            forward_store(out, lse, o, m, l, row0, t, b, h, NH, T);
    }
    if (OT && tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // (so read before exit)
}

// The persistent builds (grid: one CTA per SM; the same bits as the plain kernel), named by their
// schedule: _overlap (forward_block_overlap), _pingpong (turns), _sN (an N-deep k/v ring; 2 without).
// attention_forward 4's default is _overlap_pingpong_s4; the others are the lab's rows.
#define FWD_PERSISTENT(name, PP, OV, ST)                                                                \
    FWD4_ENTRY(flash_attention_forward_kernel4_bf16_persistent##name, bf16, flash_forward_wgmma_persistent, PP, OV, ST)
FWD_PERSISTENT(, false, false, 2)
FWD_PERSISTENT(_pingpong, true, false, 2)
FWD_PERSISTENT(_pingpong_s4, true, false, 4)
FWD_PERSISTENT(_overlap_s4, false, true, 4)
FWD_PERSISTENT(_overlap_pingpong_s3, true, true, 3)
FWD_PERSISTENT(_overlap_pingpong_s4, true, true, 4)
FWD_PERSISTENT(_overlap_pingpong_s5, true, true, 5)
FWD_PERSISTENT(_overlap_pingpong_s6, true, true, 6)

// ------------------------------------------------------------------------------------------------
// the backward (attention_backward variant 4): the two kernels of backward 3, on wgmma + TMA
//
// With p = exp(scale q k^T - lse) recomputed from the forward's lse, dp = dout v^T and D =
// rowsum(dout * out): dv = p^T dout, ds = p (dp - D), dq = scale ds k, dk = scale ds^T q. Two
// kernels, no atomics (deterministic): dq sums over key tiles inside its CTA, dk and dv over query
// tiles inside another. Both have backward 3's launch contract and the forward's CTA shape (a
// producer warpgroup, 2 consumer warpgroups x 64 rows, 128 x 128 tiles), so every tile move is a
// 128-row TMA box and every product one of the forward's two shapes:
//   "S-shape" (64 x 128 from two K-major tiles, contracting the 64 dims): issue_s
//   "O-shape" (64 x 64 += register A (64 x 128 positions) x MN-major tile (128 positions x 64 dims)):
//             the forward's P V, with the same A fragment mapping (an S-shape accumulator packed to
//             bf16 in place: no shuffles) and the same desc_mn B.
// dq kernel, CTA (bh, query block qb), key tiles 0..qb:
//   S = q k^T, dP = dout v^T          two S-shapes into sc[64], dp[64]
//   dS = P (dP - D)                    fp32 registers, P = 2^(c2 S - lse log2e), masked on tile qb
//   dq += dS k                         O-shape: k is the MN-major B (keys x dims)
// dkdv kernel, CTA (bh, key block kb), query tiles kb..nqb-1 (the diagonal first), transposed (keys
// are the rows: what it sums over, the queries, is the contraction of its O-shapes):
//   S^T = k q^T, dP^T = v dout^T       two S-shapes (k, v of the warpgroup's 64 keys as A)
//   P^T, dS^T = P^T (dP^T - D)          per column (query): lse and D of the tile from shared memory
//   dv += P^T dout, dk += dS^T q        two O-shapes: dout and q tiles as MN-major B
// Registers: sc, dp 64 each + dq 32 (dq kernel), + dk, dv 32 each (dkdv: 192 live through the
// exponentials, then the packed P^T, dS^T (32 + 32) replace sc, dp). 128-query tiles fit the
// consumers' 240 (ptxas -v: no spills); 64-query tiles would halve sc, dp but double the
// per-tile overhead (barriers, waits, lse/D staging) and make the S-shapes m64n64 (half the
// tensor-core work per shared-memory byte of A).
// Global tensors by TMA: q, k, v through the forward's 3D map of qkvr; dout through a 4D map of the
// (B,T,C) tensor as (64 dims, NH heads, T rows, B), box (64, 1, 128, 1): a head's 128 rows, 128-byte
// swizzled like q, rows past T zero-filled. The two maps sit back to back in global memory (tm[0]
// qkvr, tm[1] dout). lse and D (fp32, (B,NH,T)) are not 16-byte aligned per tile at odd T: the dq
// kernel reads its two rows' values into registers; the dkdv kernel's consumers stage each query
// tile's 128 lse and D values in shared memory (a thread per query, loaded one tile ahead).
// Zero-filled rows: a query row >= T has q = dout = 0 (dS = 0; its dq is not stored); a key >= T
// only appears in the diagonal tile of the dq kernel (masked: key > every row < T), and a query >= T
// only in the dkdv kernel's last tile (masked: p = 0 there; its lse, D are read as 0).
constexpr int BWD_STAGES = 2;                 // ring depth of the swept tiles (k, v or q, dout): TF32
// the bf16 kernels' ring depth: a build parameter (llmc/ops/attention.py passes LLMC_ATT_BWD_STAGES when
// it is not the default; its WGMMA_DQ_SMEM / WGMMA_DKDV_SMEM follow it)
#ifndef LLMC_ATT_BWD_STAGES
#define LLMC_ATT_BWD_STAGES 2
#endif
constexpr int BF_BWD_STAGES = LLMC_ATT_BWD_STAGES;
constexpr int ROWS_FLOATS = 2 * BQ;           // a query tile's lse (log2 units) then D, fp32
// dynamic shared memory (llmc/ops/attention.py keeps the same numbers: WGMMA_DQ_SMEM, WGMMA_DKDV_SMEM):
// 1 KB of alignment slack, the two resident tiles, the stages, [dkdv: 2 consumers x 2 buffers of
// lse/D rows], the mbarriers (one for the resident tiles, full and empty per stage)
constexpr int DQ_SMEM = 1024 + 2 * Q_BYTES + BF_BWD_STAGES * STAGE_BYTES + 8 * (1 + 2 * BF_BWD_STAGES);
constexpr int DKDV_SMEM = 1024 + 2 * KV_BYTES + BF_BWD_STAGES * STAGE_BYTES + 2 * 2 * ROWS_FLOATS * 4 +
                          8 * (1 + 2 * BF_BWD_STAGES);
static_assert(DQ_SMEM <= 227 * 1024 && DKDV_SMEM <= 227 * 1024, "fits one SM's shared memory");

// the O-shape: acc (64 x 64) += A (64 x 128 positions, bf16 registers) B (128 positions x 64, MN-major)
__device__ __forceinline__ void issue_o(float (&acc)[32], const uint32_t (&a)[8][4], const unsigned char* sb) {
#pragma unroll
    for (int kk = 0; kk < 8; kk++) wgmma_bf16_rs_n64<1>(acc, a[kk], desc_mn(sb + kk * 2048), 1);
}

// an S-shape accumulator (fp32) packed to bf16 as the A fragments of an O-shape (as pack_p)
__device__ __forceinline__ void pack_a(uint32_t (&a)[8][4], const float (&x)[64]) {
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) a[kk][r] = pack_bf16(x[8 * kk + 2 * r], x[8 * kk + 2 * r + 1]);
}

// One lane's part of D = rowsum(dout * out) for a (b, t, h) row: lane t of a quad sums dims 16t..16t+15
// (two 16-byte loads of each tensor; fp32 products of the bf16 values, in order), then the quad adds
// up (attention_backward 4's dq kernel and 5's prep: the same sums, the same bits)
__device__ __forceinline__ float d_partial(const bf16* dout, const bf16* out, size_t off) {
    float d = 0.0f;
#pragma unroll
    for (int u = 0; u < 2; u++) {
        const uint4 x = *reinterpret_cast<const uint4*>(dout + off + 8 * u);
        const uint4 y = *reinterpret_cast<const uint4*>(out + off + 8 * u);
        const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&x);
        const __nv_bfloat162* yp = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const float2 xf = __bfloat1622float2(xp[e]), yf = __bfloat1622float2(yp[e]);
            d = fmaf(xf.x, yf.x, d);
            d = fmaf(xf.y, yf.y, d);
        }
    }
    return d;
}

// A consumer warpgroup's 64 rows of an m64n64 accumulator (register 4j + 2hh + c at row 16 warp + g +
// 8hh, dim 8j + 2t + c), times sx, rounded to bf16 once, into dinp (B,T,3C) rows row64.. of batch b
// (rows >= T skipped), columns col0..col0 + 63, through shared memory, so that the global stores are
// whole 128-byte rows: row r's 16-byte chunk q at chunk q ^ (r % 8) of buf (8 KB only this warpgroup
// reads or writes: the 8 rows g of a warp's 4-byte writes land in 8 different bank groups), then each
// thread copies 4 chunks of 16 bytes, 8 threads a row. first: buf's previous contents have not been
// read back by this function (else a barrier first). With 4-byte stores straight from the registers
// (a warp instruction 8 rows x 16 bytes) the end of each CTA waited on them (ncu, backward 5's main
// kernel: ~8% of its stall samples); H100, bf16, d12: backward 5 0.2817 ms against 0.3105 at B=16,
// 0.0808 against 0.0867 at B=4 (with the dq reduction's .read wait).
__device__ __forceinline__ void store_rows_staged(bf16* dinp, const float (&x)[32], float sx, unsigned char* buf,
                                                  bool first, int b, int T, int C, int row64, int col0, int tid,
                                                  int cw, float* part = nullptr) {
    const int warp = tid >> 5, g = (tid >> 2) & 7, t = tid & 3;
    if (!first) wg_barrier(1 + cw);  // the previous rows all read back before they are overwritten
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int r = 16 * warp + g + 8 * hh;
#pragma unroll
        for (int j = 0; j < 8; j++)
            *reinterpret_cast<uint32_t*>(buf + r * ROW_BYTES + ((j ^ (r & 7)) << 4) + 4 * t) =
                pack_bf16(x[4 * j + 2 * hh] * sx, x[4 * j + 2 * hh + 1] * sx);
    }
    wg_barrier(1 + cw);
    float s[8];  // part: this thread's column sums (columns 8q.., its 4 rows r, r + 16, ...) of the values stored
#pragma unroll
    for (int e = 0; e < 8; e++) s[e] = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const int c = tid + 128 * k, r = c >> 3, q = c & 7, row = row64 + r;
        const uint4 v = *reinterpret_cast<const uint4*>(buf + r * ROW_BYTES + ((q ^ (r & 7)) << 4));
        if (row < T) {
            *reinterpret_cast<uint4*>(dinp + ((size_t)b * T + row) * 3 * C + col0 + 8 * q) = v;
            if (part != nullptr) {
                s[0] += unpack_lo(v.x); s[1] += unpack_hi(v.x); s[2] += unpack_lo(v.y); s[3] += unpack_hi(v.y);
                s[4] += unpack_lo(v.z); s[5] += unpack_hi(v.z); s[6] += unpack_lo(v.w); s[7] += unpack_hi(v.w);
            }
        }
    }
    if (part != nullptr) {  // (the same for the whole warpgroup) the 64 rows' column sums into part[0..63]
        // lanes l, l ^ 8, l ^ 16, l ^ 24 hold the same 8 columns: after two xor steps each has the warp's
        // 16 rows; then the 4 warps' sums through buf (read back above by all: a barrier first), in order
#pragma unroll
        for (int e = 0; e < 8; e++) {
            s[e] += __shfl_xor_sync(0xffffffffu, s[e], 8);
            s[e] += __shfl_xor_sync(0xffffffffu, s[e], 16);
        }
        wg_barrier(1 + cw);
        float* sf = reinterpret_cast<float*>(buf);
        if ((tid & 31) < 8) {
#pragma unroll
            for (int e = 0; e < 8; e++) sf[(tid >> 5) * 64 + 8 * (tid & 7) + e] = s[e];
        }
        wg_barrier(1 + cw);
        if (tid < 64) part[tid] = ((sf[tid] + sf[64 + tid]) + sf[128 + tid]) + sf[192 + tid];
    }
}

// dk * scale -> dinp[..., C:2C], dv -> dinp[..., 2C:3C] (head h), one bf16 rounding each, through buf:
// the warpgroup's own rows of the v tile, which only its own dP^T products read, all completed by now
// part (attention_backward 5's colsum form; nullptr: none): the row of column-sum partials of these 64
// keys (B T / 64 rows of 3C fp32): its dk and dv columns get the sums of the values as stored
__device__ __forceinline__ void store_dkdv(bf16* dinp, const float (&dk)[32], const float (&dv)[32], unsigned char* buf,
                                           int b, int h, int T, int C, int k64, int tid, int cw, float scale,
                                           float* part = nullptr) {
    store_rows_staged(dinp, dk, scale, buf, true, b, T, C, k64, C + h * HS, tid, cw,
                      part != nullptr ? part + C + h * HS : nullptr);
    store_rows_staged(dinp, dv, 1.0f, buf, false, b, T, C, k64, 2 * C + h * HS, tid, cw,
                      part != nullptr ? part + 2 * C + h * HS : nullptr);
}

// Backward, part 1: per (b, h, 128 query rows), D = rowsum(dout * out) (written for part 2) and
// dq = scale sum over key tiles 0..qb of (p (dp - D)) k. tm: tm[0] the map of q, k, v (BTC: of the
// (B,T,3C) qkv tensor, else of the permuted qkvr; see Layouts), tm[1] the dout map.
// OVERLAP: tile i's dq product is left running while tile i + 1's S and dP are issued (one wait for
// both instead of two), at the cost of keeping the packed dS (32 registers) live across that issue;
// the same operations on each accumulator in the same order: the same bits (the lab times both).
// PINGPONG (not with OVERLAP): the consumers take turns issuing (PingPong above): 2 nkt turns each,
// S and dP of a tile, then its dq product; one's dS runs beside the other's products.
template <bool OVERLAP, bool BTC, bool PINGPONG = false>
__device__ __forceinline__ void flash_backward_dq_wgmma(bf16* dinp, float* Dbuf, const bf16* dout, const bf16* out,
                                                        const CUtensorMap* tm, const float* lse, int B, int NH, int T,
                                                        float scale, float* part) {
    extern __shared__ unsigned char smem_bwd[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_bwd) + 1023) & ~uintptr_t(1023));
    unsigned char* sq = smem;                    // q (128 x 64)
    unsigned char* sdo = smem + Q_BYTES;         // dout (128 x 64)
    unsigned char* skv = smem + 2 * Q_BYTES;     // stage s: k at skv + s * STAGE_BYTES, v KV_BYTES after it
    uint64_t* qd_full = reinterpret_cast<uint64_t*>(skv + BF_BWD_STAGES * STAGE_BYTES);
    uint64_t* full = qd_full + 1;
    uint64_t* empty = full + BF_BWD_STAGES;

    const int C = NH * HS;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int qb = gridDim.y - 1 - blockIdx.y;  // the query blocks with the most key tiles first
    const int q0 = qb * BQ;
    const int nkt = qb + 1;                     // key tiles 0..qb; tile qb holds the diagonal

    if (threadIdx.x == 0) mbar_init_pipeline(qd_full, full, empty, BF_BWD_STAGES, CONSUMER_WARPS);
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (threadIdx.x == 0) {
            tensormap_acquire(tm);
            tensormap_acquire(tm + 1);
            mbar_expect_tx(qd_full, 2 * Q_BYTES);
            tma_load_head<BTC>(sq, tm, qd_full, 0, q0, B, NH, b, h);  // q
            tma_load_4d(sdo, tm + 1, qd_full, 0, h, q0, b);    // dout
            load_kv_tiles<BTC, BF_BWD_STAGES>(skv, tm, full, empty, nkt, B, NH, b, h);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

    const int cw = wg - 1;  // consumer: query rows 64 cw .. 64 cw + 63 of the block
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int row0 = q0 + 64 * cw + 16 * warp + g;  // this thread's rows: row0 (h = 0), row0 + 8 (h = 1)
    const float c2 = scale * LOG2E;
    const unsigned char* sqw = sq + cw * 64 * ROW_BYTES;
    const unsigned char* sdow = sdo + cw * 64 * ROW_BYTES;

    // D and lse (log2 units) of this thread's two rows, while the TMA brings q and dout. D: the 4
    // lanes of a quad share a row, lane t sums columns 16t..16t+15 (two 16-byte loads of each
    // tensor), then the quad adds up; fp32 products of the bf16 values.
    float Dr[2], lr[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = row0 + 8 * hh;
        float d = row < T ? d_partial(dout, out, ((size_t)b * T + row) * C + h * HS + 16 * t) : 0.0f;
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        Dr[hh] = d;
        lr[hh] = row < T ? lse[(size_t)bh * T + row] * LOG2E : 0.0f;
        if (row < T && t == 0) Dbuf[(size_t)bh * T + row] = d;
    }

    float dq[32];
#pragma unroll
    for (int i = 0; i < 32; i++) dq[i] = 0.0f;
    float sc[64], dp[64];
    uint32_t da[8][4];
    auto stage = [&](int i) { return skv + (i % BF_BWD_STAGES) * STAGE_BYTES; };
    // S = q k^T and dP = dout v^T of key tile i, issued as one group
    static_assert(!(OVERLAP && PINGPONG), "ping-pong turns are the plain loop's issue batches");
    const PingPong<PINGPONG> turn{cw};
    auto issue_sdp = [&](int i) {
        mbar_wait(&full[i % BF_BWD_STAGES], (i / BF_BWD_STAGES) & 1);
        turn.begin();
        wgmma_fence();
        issue_s(sc, sqw, stage(i));
        issue_s(dp, sdow, stage(i) + KV_BYTES);
        wgmma_commit();
        turn.end(false);
    };
    // dS = P (dP - D), P = 2^(c2 S - lse log2e), packed to bf16 as dq's A operand. On the diagonal
    // tile (the last) keys > row are masked (so are keys >= T, zero-filled: > every row < T).
    // Accumulator layout: register 4j + e at row row0 + 8 (e >> 1), key 8j + 2t + (e & 1) of the tile.
    auto make_ds = [&](int i) {
        keep_in_regs(sc);
        keep_in_regs(dp);
        if (i == nkt - 1) mask_scores<16>(sc, row0 - i * BKV - 2 * t);  // the diagonal tile
#pragma unroll
        for (int j = 0; j < 16; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int hh = e >> 1;
                const float p = ex2(fmaf(sc[4 * j + e], c2, -lr[hh]));  // masked: 2^-inf = +0
                sc[4 * j + e] = p * (dp[4 * j + e] - Dr[hh]);
            }
        pack_a(da, sc);
    };
    // both products of tile i have read its stage: hand it back (one arrival per consumer warp)
    auto release = [&](int i) { __syncwarp(); if (lane == 0) mbar_arrive(&empty[i % BF_BWD_STAGES]); };
    mbar_wait(qd_full, 0);
    if constexpr (!OVERLAP) {
        turn.start();
        for (int i = 0; i < nkt; i++) {
            issue_sdp(i);
            wgmma_wait<0>();
            make_ds(i);
            turn.begin();
            wgmma_fence();
            issue_o(dq, da, stage(i));  // dq += dS k (k as the MN-major B: keys x dims)
            wgmma_commit();
            turn.end(i == nkt - 1);
            wgmma_wait<0>();
            keep_in_regs(dq);
            release(i);
        }
    } else {
        issue_sdp(0);
        wgmma_wait<0>();
        make_ds(0);
        for (int i = 0; i < nkt; i++) {
            wgmma_fence();
            issue_o(dq, da, stage(i));  // runs while the next tile's S, dP are issued
            wgmma_commit();
            if (i + 1 < nkt) issue_sdp(i + 1);
            wgmma_wait<0>();  // dq of tile i and S, dP of tile i + 1
            keep_in_regs(dq);
            release(i);
            if (i + 1 < nkt) make_ds(i + 1);
        }
    }

    // dq * scale -> dinp[..., 0:C], one bf16 rounding, through the warpgroup's own rows of the q tile
    // (only its own S products read them, all completed by now)
    // (colsum form: part, the partials; else nullptr) this warpgroup's 64 rows' q column sums into their row
    const int r64 = q0 + 64 * cw;
    float* prow = part != nullptr && r64 < T ? part + ((size_t)b * ((T + 63) / 64) + r64 / 64) * 3 * C + h * HS : nullptr;
    store_rows_staged(dinp, dq, scale, const_cast<unsigned char*>(sqw), true, b, T, C, r64, h * HS, tid, cw, prow);
}

// The dq kernels' entry points (bf16 and TF32): NAME(dinp, Dbuf, dout, out, tm, lse, B, NH, T, scale, part)
// runs FN<TARGS...> on the same arguments. DT: the type of dinp, dout and out (bf16, or float in the TF32
// builds); tm: the bf16 builds' pair of maps (qkvr or qkv, dout), the TF32 builds' array of maps (maps in
// flash_backward_dq_wgmma_tf32 and flash_backward_dkdv_wgmma_tf32)
#define BWD4_DQ_ENTRY(NAME, DT, FN, ...)                                                                \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                            \
    NAME(DT* dinp, float* Dbuf, const DT* dout, const DT* out, const CUtensorMap* tm, const float* lse, \
         int B, int NH, int T, float scale, float* part) {                                              \
        LLMC_PDL_WAIT();                                                                                \
        FN<__VA_ARGS__>(dinp, Dbuf, dout, out, tm, lse, B, NH, T, scale, part);                         \
    }
// flash_attention_backward_dq_kernel4_bf16<SFX>: flash_backward_dq_wgmma<OVERLAP, BTC[, PINGPONG]>
#define BWD4_DQ_BF16(SFX, ...)                                                                          \
    BWD4_DQ_ENTRY(flash_attention_backward_dq_kernel4_bf16##SFX, bf16, flash_backward_dq_wgmma, __VA_ARGS__)
BWD4_DQ_BF16(, false, false)
// q, k, v from the (B,T,3C) qkv tensor itself (the build with qkv_in_place=True)
BWD4_DQ_BF16(_btc, false, true)
// the lab's in-place pingpong=True build (the consumers take turns issuing; the same bits)
BWD4_DQ_BF16(_btc_pingpong, false, true, true)
// the lab's overlap=True build (llmc/ops/attention.py); the same bits as the plain one
BWD4_DQ_BF16(_overlap, true, false)

// The dk/dv kernels' producer (attention_backward 4 and 5; thread 0 of warpgroup 0): k and v of the
// key block once, then q and dout of query tiles kb..kb + nt - 1 into the ST-deep ring
template <bool BTC, int ST>
__device__ __forceinline__ void dkdv_producer(unsigned char* sk, unsigned char* sv, unsigned char* sqd, uint64_t* kv_full,
                                              uint64_t* full, uint64_t* empty, const CUtensorMap* tm, int B, int NH,
                                              int b, int h, int kb, int nt) {
    tensormap_acquire(tm);
    tensormap_acquire(tm + 1);
    mbar_expect_tx(kv_full, 2 * KV_BYTES);
    tma_load_head<BTC>(sk, tm, kv_full, 1, kb * BKV, B, NH, b, h);  // k
    tma_load_head<BTC>(sv, tm, kv_full, 2, kb * BKV, B, NH, b, h);  // v
    for (int i = 0; i < nt; i++) {
        const int s = i % ST, use = i / ST, r0 = (kb + i) * BQ;
        mbar_wait(&empty[s], (use & 1) ^ 1);
        mbar_expect_tx(&full[s], STAGE_BYTES);
        unsigned char* st = sqd + s * STAGE_BYTES;
        tma_load_head<BTC>(st, tm, &full[s], 0, r0, B, NH, b, h);   // q
        tma_load_4d(st + KV_BYTES, tm + 1, &full[s], 0, h, r0, b);  // dout
    }
}

template <int ST, bool PP, typename LoadRows>
__device__ __forceinline__ const unsigned char* dkdv_tile_scores(float (&sc)[64], float (&dp)[64], float* r, float& l_next,
                                                                 float& d_next, LoadRows load_rows, int i, int nt, int tid,
                                                                 int cw, const unsigned char* sqd, uint64_t* full,
                                                                 const unsigned char* skw, const unsigned char* svw,
                                                                 const PingPong<PP>& turn) {
    r[tid] = l_next * LOG2E;  // lse to log2 units here, a tile after its load (see load_rows)
    r[BQ + tid] = d_next;
    if (i + 1 < nt) load_rows(i + 1, l_next, d_next);
    wg_barrier(1 + cw);
    const unsigned char* sqt = sqd + (i % ST) * STAGE_BYTES;
    mbar_wait(&full[i % ST], (i / ST) & 1);
    turn.begin();
    wgmma_fence();
    issue_s(sc, skw, sqt);             // S^T = k q^T
    issue_s(dp, svw, sqt + KV_BYTES);  // dP^T = v dout^T
    wgmma_commit();
    turn.end(false);
    wgmma_wait<0>();
    keep_in_regs(sc);
    keep_in_regs(dp);
    return sqt;
}

// Backward, part 2: per (b, h, 128 keys), over the query tiles kb..nqb-1, dv = sum p^T dout and
// dk = scale sum (p (dp - D))^T q, transposed (keys as rows). Reads D from part 1. tm, BTC: as part 1.
// PINGPONG: the consumers take turns issuing, 2 nt turns each (S^T and dP^T of a tile, then dv and dk).
template <bool BTC, bool PINGPONG = false>
__device__ __forceinline__ void flash_backward_dkdv_wgmma(bf16* dinp, const CUtensorMap* tm, const float* lse,
                                                          const float* Dbuf, int B, int NH, int T, float scale,
                                                          float* part) {
    extern __shared__ unsigned char smem_bwd[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_bwd) + 1023) & ~uintptr_t(1023));
    unsigned char* sk = smem;                      // k (128 keys x 64)
    unsigned char* sv = smem + KV_BYTES;           // v (128 keys x 64)
    unsigned char* sqd = smem + 2 * KV_BYTES;      // stage s: q at sqd + s * STAGE_BYTES, dout KV_BYTES after it
    float* rows = reinterpret_cast<float*>(sqd + BF_BWD_STAGES * STAGE_BYTES);  // [consumer][buffer][lse | D]
    uint64_t* kv_full = reinterpret_cast<uint64_t*>(rows + 2 * 2 * ROWS_FLOATS);
    uint64_t* full = kv_full + 1;
    uint64_t* empty = full + BF_BWD_STAGES;

    const int C = NH * HS;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int kb = blockIdx.y;                  // key block 0 has the most query tiles: it starts first
    const int k0 = kb * BKV;
    const int nqb = gridDim.y, nt = nqb - kb;   // query tiles kb..nqb-1; tile kb holds the diagonal

    if (threadIdx.x == 0) mbar_init_pipeline(kv_full, full, empty, BF_BWD_STAGES, CONSUMER_WARPS);
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (threadIdx.x == 0) dkdv_producer<BTC, BF_BWD_STAGES>(sk, sv, sqd, kv_full, full, empty, tm, B, NH, b, h, kb, nt);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

    const int cw = wg - 1;  // consumer: keys 64 cw .. 64 cw + 63 of the block
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int key0 = k0 + 64 * cw + 16 * warp + g;  // this thread's keys: key0 (h = 0), key0 + 8 (h = 1)
    const float c2 = scale * LOG2E;
    const unsigned char* skw = sk + cw * 64 * ROW_BYTES;
    const unsigned char* svw = sv + cw * 64 * ROW_BYTES;
    float* myrows = rows + cw * 2 * ROWS_FLOATS;  // this warpgroup's two buffers of a tile's lse, D
    const float* lseh = lse + (size_t)bh * T;
    const float* Dh = Dbuf + (size_t)bh * T;

    // a thread per query of the tile: its lse and D, 0 past T; loaded a tile ahead (lse goes to log2 units
    // where dkdv_tile_scores stages it: a multiply here would wait for the load right away)
    auto load_rows = [&](int i, float& l, float& d) {
        const int qpos = (kb + i) * BQ + tid;
        l = qpos < T ? lseh[qpos] : 0.0f;
        d = qpos < T ? Dh[qpos] : 0.0f;
    };
    float l_next, d_next;
    load_rows(0, l_next, d_next);

    float dk[32], dv[32];
#pragma unroll
    for (int i = 0; i < 32; i++) dk[i] = dv[i] = 0.0f;
    float sc[64], dp[64];
    uint32_t pa[8][4], da[8][4];
    mbar_wait(kv_full, 0);
    const PingPong<PINGPONG> turn{cw};
    turn.start();
    for (int i = 0; i < nt; i++) {
        float* r = myrows + (i & 1) * ROWS_FLOATS;  // this tile's lse, D (staged by dkdv_tile_scores)
        const unsigned char* sqt = dkdv_tile_scores<BF_BWD_STAGES>(sc, dp, r, l_next, d_next, load_rows, i, nt, tid, cw,
                                                                   sqd, full, skw, svw, turn);
        // P^T = 2^(c2 S^T - lse log2e) per column (query), dS^T = P^T (dP^T - D). Masked: the diagonal
        // tile (i = 0: queries < key) and the last (queries >= T, zero-filled). Register 4j + e: key
        // key0 + 8 (e >> 1), query q0 + 8j + 2t + (e & 1); its lse, D pair is one float2 load.
        const int q0 = (kb + i) * BQ;
        if (i == 0 || i == nt - 1) mask_scores_t<16>(sc, q0 + 2 * t - key0, T - q0 - 2 * t);
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const float2 lq = *reinterpret_cast<const float2*>(r + 8 * j + 2 * t);
            const float2 dd = *reinterpret_cast<const float2*>(r + BQ + 8 * j + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = e & 1;
                const float p = ex2(fmaf(sc[4 * j + e], c2, -(c ? lq.y : lq.x)));  // masked: 2^-inf = +0
                sc[4 * j + e] = p;
                dp[4 * j + e] = p * (dp[4 * j + e] - (c ? dd.y : dd.x));
            }
        }
        pack_a(pa, sc);
        pack_a(da, dp);
        turn.begin();
        wgmma_fence();
        issue_o(dv, pa, sqt + KV_BYTES);  // dv += P^T dout
        issue_o(dk, da, sqt);             // dk += dS^T q
        wgmma_commit();
        turn.end(i == nt - 1);
        wgmma_wait<0>();
        keep_in_regs(dv);
        keep_in_regs(dk);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[i % BF_BWD_STAGES]);
    }

    const int k64 = k0 + 64 * cw;  // (colsum form) this warpgroup's 64 keys' row of partials: dk's and dv's sums
    float* prow = part != nullptr && k64 < T ? part + ((size_t)b * ((T + 63) / 64) + k64 / 64) * 3 * C : nullptr;
    store_dkdv(dinp, dk, dv, const_cast<unsigned char*>(svw), b, h, T, C, k64, tid, cw, scale, prow);
}

// The dk/dv kernels' entry points (bf16 and TF32): NAME(dinp, tm, lse, Dbuf, B, NH, T, scale, part) runs
// FN<TARGS...> on the same arguments; DT, tm: as the dq kernels'.
// part (the dq and dk/dv kernels): the colsum form's partials (B ceil(T / 64), 3C) fp32, or nullptr
#define BWD4_DKDV_ENTRY(NAME, DT, FN, ...)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                            \
    NAME(DT* dinp, const CUtensorMap* tm, const float* lse, const float* Dbuf, int B, int NH, int T,    \
         float scale, float* part) {                                                                    \
        LLMC_PDL_WAIT();                                                                                \
        FN<__VA_ARGS__>(dinp, tm, lse, Dbuf, B, NH, T, scale, part);                                    \
    }
// flash_attention_backward_dkdv_kernel4_bf16<SFX>: flash_backward_dkdv_wgmma<BTC[, PINGPONG]>
#define BWD4_DKDV_BF16(SFX, ...)                                                                        \
    BWD4_DKDV_ENTRY(flash_attention_backward_dkdv_kernel4_bf16##SFX, bf16, flash_backward_dkdv_wgmma, __VA_ARGS__)
BWD4_DKDV_BF16(, false)
BWD4_DKDV_BF16(_btc, true)
BWD4_DKDV_BF16(_btc_pingpong, true, true)

// ------------------------------------------------------------------------------------------------
// attention_backward variant 5 (bf16): one pass over the tile pairs, dq by fp32 reductions in global
// memory (FlashAttention-2's split; not deterministic: the order the reductions land in varies)
//
// Variant 4 computes S and dP twice, once in each of its kernels: 7 products per tile pair. Here the
// dk/dv kernel also forms the tile pair's dq contribution, dS k, and adds it into an fp32 buffer
// dq_acc (B, NH, T, 64) by TMA reductions: 5 products per pair. Three launches:
//   prep     D = rowsum(dout * out) (the same fp32 sums as variant 4's dq kernel: the same bits; a quad
//            of threads per (b, t, h) row) and dq_acc zeroed (4 coalesced float4 stores a thread)
//   main     variant 4's dk/dv loop (the same products, the same dk and dv bits), and per query tile
//            after dS^T is formed:
//              each consumer stores its dS^T (64 keys x 128 queries, bf16) to shared memory, as two
//              halves of 64 queries, each 128 keys x 128 bytes, 128-byte swizzled by key row (dk's
//              product reads its A from there too, so dS^T is never packed in registers);
//              consumer cw: dq (queries 64 cw.. + 63 x 64 dims) = dS k over the block's 128 keys,
//              8 x wgmma m64n64k16 with A = dS from shared memory read transposed (M-major: the
//              stored rows are keys) and B = k (keys x dims, N-major, the O-shape's desc_mn);
//              its rows staged in shared memory (fp32) and added into dq_acc by two TMA reductions
//              (cp.reduce.async.bulk.tensor, 32 dims x 64 rows each; rows >= T out of the map)
//            dq needs both consumers' halves of dS^T. A barrier of the two per tile would put them in
//            lockstep and undo the ping-pong (measured: 0.4156 ms against 4's 0.3819, H100, B=16), so
//            tile i's dq product is issued with tile i + 1's dv and dk (the last tile's in one more
//            turn), when the other consumer finished tile i's dS^T long ago; the dS^T buffers are a
//            ring of DS_RING = 2 on mbarriers: ds_full (8 consumer warps arrive after storing and a
//            proxy fence), ds_empty (8 arrive after their dq product of that tile completed).
//            The reductions replaced 16 red.global.add.v2.f32 a thread and tile, which cost the main
//            kernel 0.125 of its 0.350 ms (H100, B=16: 0.224 with them left out)
//   convert  dinp[..., 0:C] = bf16(scale dq_acc), one rounding (8 elements a thread)
constexpr int DS_HALF_BYTES = BKV * ROW_BYTES;   // 128 keys x 64 queries bf16 = 16 KB
constexpr int DS_BYTES = 2 * DS_HALF_BYTES;      // one tile's dS^T
constexpr int DS_RING = 2;                      // dS^T buffers (see the main kernel's schedule above)
constexpr int DQ_STAGE_BYTES = 64 * HS * 4;     // a consumer's 64 dq rows, fp32: 16 KB
constexpr int V5_STAGES = 2;                    // the q / dout ring (not LLMC_ATT_BWD_STAGES: 3 would not fit)
constexpr int ZERO_TILES = 16;                  // (main_zeroes form) its zero_ready mbarriers: T <= 16 BQ
constexpr int DKDVQ_SMEM = 1024 + 2 * KV_BYTES + V5_STAGES * STAGE_BYTES + DS_RING * DS_BYTES + 2 * DQ_STAGE_BYTES +
                           2 * 2 * ROWS_FLOATS * 4 + 8 * (1 + 2 * V5_STAGES + 2 * DS_RING + ZERO_TILES);
static_assert(DKDVQ_SMEM <= 227 * 1024, "fits one SM's shared memory");

// the box at (c0 = dim, c1 = row, c2 = head bh) of dq_acc += the staged box in shared memory (fp32 add
// at the L2; out-of-bounds rows skipped), in the issuing thread's bulk group
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void bulk_wait_read_att() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// The main kernel's own zeroing of dq_acc (the _mz entry points: the build's main_zeroes form, in place
// only; prep then only writes D). Prep's zeroing wrote the whole accumulator (50 MB at d12 B=16, as large
// as the L2) long before the reductions into it, so the zeros went out to DRAM and the reductions' first
// touches read them back. Here the CTA of key block kb zeroes query tile kb of its head (its diagonal
// tile, the first it adds into) with the producer warpgroup's three idle warps as it starts, and sets
// the tile's flag zs[kb] (release). Thread 32 (the producer warpgroup's warp 1) then takes the tiles the
// CTA adds into, kb..nqb-1, in order: waits for each tile's flag (acquire; another CTA's) and arrives on
// the tile's mbarrier zero_ready[q - kb], which the consumers wait on before their reductions into it (the
// spin stays out of the consumers: a divergent loop there made ptxas serialize their wgmma). A CTA waits
// for CTAs of its own head and group, which the host keeps to at most one CTA per SM (G nqb <= SMs), so
// all of them can be resident together. zs[nqb] counts the head's CTAs past their waits; the last resets
// the head's nqb + 1 words for the next launch. (Session 46's first form, key block 0's CTA zeroing the
// whole head: main kernel +5.5% in the lab, B=16.)
constexpr int ZERO_THREADS = 96;  // the producer warpgroup's warps 1-3 (named barrier 5)
__device__ __forceinline__ void dq_zero_ready(float* dq_head, unsigned* zs, uint64_t* zero_ready, int kb, int T,
                                              int nqb, int tz) {
    {  // query tile kb of this head
        float4* p = reinterpret_cast<float4*>(dq_head + (size_t)kb * BQ * HS);
        const int n4 = min(BQ, T - kb * BQ) * HS / 4;
        for (int i = tz; i < n4; i += ZERO_THREADS) p[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        // (generic-proxy stores, read by TMA reductions: the async proxy)
        asm volatile("fence.proxy.async.global;" ::: "memory");
        __threadfence();
        asm volatile("bar.sync 5, %0;" ::"n"(ZERO_THREADS) : "memory");
    }
    if (tz != 0) return;
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(zs + kb), "r"(1u) : "memory");
    mbar_arrive(&zero_ready[0]);
    for (int q = kb + 1; q < nqb; q++) {
        for (;;) {
            unsigned v;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(zs + q) : "memory");
            if (v != 0u) break;
            __nanosleep(64);
        }
        asm volatile("fence.proxy.async.global;" ::: "memory");
        mbar_arrive(&zero_ready[q - kb]);
    }
    if (atomicAdd(zs + nqb, 1u) == (unsigned)nqb - 1) {  // the head's last CTA here: reset for the next launch
        for (int q = 0; q <= nqb; q++) zs[q] = 0u;
    }
}

// prep: a quad of threads per (b, t, h) row, h fastest (dout and out rows read contiguously); with
// zero_acc == 0 the accumulator is left alone (the caller keeps it zeroed: the build's caller_zeroes form)
extern "C" __global__ void __launch_bounds__(256)
flash_attention_backward_prep_kernel5_bf16(float* Dbuf, float* dq_acc, const bf16* dout, const bf16* out, int B,
                                           int NH, int T, int zero_acc) {
    LLMC_PDL_WAIT();
    const int C = NH * HS;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = idx >> 2;                    // (b t) * NH + h
    const int t = threadIdx.x & 3;
    const bool ok = r < (long long)B * T * NH;       // whole quads share it
    float d = 0.0f;
    if (ok) {
        const long long bt = r / NH;
        const int h = (int)(r % NH);
        d = d_partial(dout, out, (size_t)bt * C + h * HS + 16 * t);  // as variant 4's dq kernel: the same bits
        // and 4 float4 of dq_acc zeroed (B T C / 4 of them, 4 a thread: float4 u * n + idx, n = B T NH 4,
        // each store of a warp 512 contiguous bytes)
        const long long n = (long long)B * T * NH * 4;
        if (zero_acc) {
#pragma unroll
            for (int u = 0; u < 4; u++) reinterpret_cast<float4*>(dq_acc)[u * n + idx] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    d += __shfl_xor_sync(0xffffffffu, d, 1);
    d += __shfl_xor_sync(0xffffffffu, d, 2);
    if (ok && t == 0) {
        const long long bt = r / NH;
        const int h = (int)(r % NH), b = (int)(bt / T), tt = (int)(bt % T);
        Dbuf[((size_t)b * NH + h) * T + tt] = d;
    }
}

// convert: dinp[b, t, h * 64 + d] = bf16(scale dq_acc[b, h, t, d]), 8 elements a thread (dinp order)
extern "C" __global__ void __launch_bounds__(256)
flash_attention_backward_convert_kernel5_bf16(bf16* dinp, const float* dq_acc, int B, int NH, int T, float scale) {
    LLMC_PDL_WAIT();
    const int C = NH * HS;
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8;  // (b t) * C + h * 64 + d
    if (i >= (long long)B * T * C) return;
    const long long bt = i / C;
    const int c = (int)(i % C), h = c / HS, d = c % HS;
    const float* src = dq_acc + ((size_t)((bt / T) * NH + h) * T + bt % T) * HS + d;
    const float4 a = *reinterpret_cast<const float4*>(src);
    const float4 b = *reinterpret_cast<const float4*>(src + 4);
    uint4 o;
    o.x = pack_bf16(a.x * scale, a.y * scale);
    o.y = pack_bf16(a.z * scale, a.w * scale);
    o.z = pack_bf16(b.x * scale, b.y * scale);
    o.w = pack_bf16(b.z * scale, b.w * scale);
    *reinterpret_cast<uint4*>(dinp + bt * 3 * C + c) = o;
}

// main: variant 4's dk/dv kernel (flash_backward_dkdv_wgmma, the same loop) plus each tile's dq
// contribution (see above). tm, BTC, PINGPONG: as variant 4.
template <bool BTC, bool PINGPONG = false, bool ZERO = false>
__device__ __forceinline__ void flash_backward_dkdvq_wgmma(bf16* dinp, float* dq_acc, const CUtensorMap* tm,
                                                           const float* lse, const float* Dbuf, int B, int NH, int T,
                                                           float scale, int G, float* part, unsigned* zs) {
    extern __shared__ unsigned char smem_bwd[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_bwd) + 1023) & ~uintptr_t(1023));
    unsigned char* sk = smem;                      // k (128 keys x 64)
    unsigned char* sv = smem + KV_BYTES;           // v (128 keys x 64)
    unsigned char* sqd = smem + 2 * KV_BYTES;      // stage s: q at sqd + s * STAGE_BYTES, dout KV_BYTES after it
    unsigned char* sds = sqd + V5_STAGES * STAGE_BYTES;  // DS_RING buffers of dS^T, DS_BYTES each (1 KB aligned)
    unsigned char* sdq = sds + DS_RING * DS_BYTES;  // per consumer: its dq rows (fp32) staged for the TMA
    float* rows = reinterpret_cast<float*>(sdq + 2 * DQ_STAGE_BYTES);  // [consumer][buffer][lse | D]
    uint64_t* kv_full = reinterpret_cast<uint64_t*>(rows + 2 * 2 * ROWS_FLOATS);
    uint64_t* full = kv_full + 1;
    uint64_t* empty = full + V5_STAGES;
    uint64_t* ds_full = empty + V5_STAGES;  // a dS^T buffer written (both consumers' warps arrive)
    uint64_t* ds_empty = ds_full + DS_RING;     // a dS^T buffer read by both consumers' dq products
    uint64_t* zero_ready = ds_empty + DS_RING;  // (main_zeroes form) ZERO_TILES: query tile kb + u is zeroed

    const int C = NH * HS;
    // The order the CTAs start in (a 1D grid of nqb x B NH): groups of G heads one after the other, in
    // a group key block 0 of every head first, then key block 1, ... (the blocks with the most query
    // tiles first, as 4). G is chosen on the host so that the group's dq rows (G x T x 256 bytes) stay
    // in the L2 while its CTAs add into them: at d12 B=16 dq_acc is 50 MB, and with all heads in one
    // group the reductions went to DRAM (main kernel 0.3354 ms against 0.2244 with no dq output at all).
    const int nqb = (T + BQ - 1) / BQ;
    const int BNH = B * NH, grp = blockIdx.x / (G * nqb), r = blockIdx.x % (G * nqb);
    const int Gg = min(G, BNH - grp * G);      // (the last group may be smaller)
    const int kb = r / Gg;                      // key block 0 has the most query tiles: it starts first
    const int bh = grp * G + r % Gg, b = bh / NH, h = bh % NH;
    const int k0 = kb * BKV;
    const int nt = nqb - kb;                    // query tiles kb..nqb-1; tile kb holds the diagonal

    if (threadIdx.x == 0) {
        for (int u = 0; u < DS_RING; u++) {
            mbar_init(&ds_full[u], CONSUMER_WARPS);
            mbar_init(&ds_empty[u], CONSUMER_WARPS);
        }
        if constexpr (ZERO)
            for (int u = 0; u < nt; u++) mbar_init(&zero_ready[u], 1);
        mbar_init_pipeline(kv_full, full, empty, V5_STAGES, CONSUMER_WARPS);  // (its fence covers these)
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (threadIdx.x == 0)
            dkdv_producer<BTC, V5_STAGES>(sk, sv, sqd, kv_full, full, empty, tm, B, NH, b, h, kb, nt);
        else if (ZERO && threadIdx.x >= 32)
            dq_zero_ready(dq_acc + (size_t)bh * T * HS, zs + (size_t)bh * (nqb + 1), zero_ready, kb, T, nqb,
                          threadIdx.x - 32);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

    const int cw = uniform_cw(wg - 1);  // consumer: keys 64 cw .. 64 cw + 63 of the block; queries 64 cw.. of dq
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int key0 = k0 + 64 * cw + 16 * warp + g;  // this thread's keys: key0 (h = 0), key0 + 8 (h = 1)
    const float c2 = scale * LOG2E;
    const unsigned char* skw = sk + cw * 64 * ROW_BYTES;
    const unsigned char* svw = sv + cw * 64 * ROW_BYTES;
    float* myrows = rows + cw * 2 * ROWS_FLOATS;  // this warpgroup's two buffers of a tile's lse, D

    // (lse, D and dq_acc addressed from the kernel's parameters where used: fewer live registers)
    auto load_rows = [&](int i, float& l, float& d) {
        const int qpos = (kb + i) * BQ + tid;
        l = qpos < T ? lse[(size_t)bh * T + qpos] : 0.0f;
        d = qpos < T ? Dbuf[(size_t)bh * T + qpos] : 0.0f;
    };
    float l_next, d_next;
    load_rows(0, l_next, d_next);

    float dk[32], dv[32];
#pragma unroll
    for (int i = 0; i < 32; i++) dk[i] = dv[i] = 0.0f;
    float sc[64], dp[64];
    uint32_t pa[8][4];
    mbar_wait(kv_full, 0);
    const PingPong<PINGPONG> turn{cw};
    // dq (queries 64 cw.., 64 dims) of tile u = dS k: A = half cw of tile u's dS^T (both consumers'
    // rows), M-major; k-step kk is keys 16 kk.. (two 1024-byte atoms of 8 key rows); B = k, N-major
    auto issue_dq = [&](float (&dq)[32], int u) {
        const unsigned char* dsb = sds + (u % DS_RING) * DS_BYTES + cw * DS_HALF_BYTES;
#pragma unroll
        for (int kk = 0; kk < 8; kk++) wgmma_bf16_n64<1, 1>(dq, desc_mn(dsb + kk * 2048), desc_mn(sk + kk * 2048), kk > 0);
    };
    // consumer 0's dq of the diagonal tile (u = 0): keys 0..63 only (ATT_DIAG_SKIP above); its dS^T half at sds
    auto issue_dq_diag_lo = [&](float (&dq)[32]) {
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wgmma_bf16_n64<1, 1>(dq, desc_mn(sds + kk * 2048), desc_mn(sk + kk * 2048), kk > 0);
    };
    // after tile u's dq product completed: its dS^T buffer is free (for this consumer); its rows go
    // through this consumer's staging buffer in shared memory (fp32, two boxes of 32 dims x 64 rows,
    // 128-byte swizzled) and are added into dq_acc by two TMA reductions (rows >= T are out of the
    // map's bounds: not written). Register 4j + 2hh + c: row 16 warp + g + 8 hh, dim 8j + 2t + c, i.e.
    // box j / 4, 16-byte chunk 2 (j % 4) + t / 2 of the row, bytes 8 (t % 2) into it; row % 8 = g.
    const uint32_t st0 = smem_u32(sdq + cw * DQ_STAGE_BYTES) + (16 * warp + g) * 128 + 8 * (t & 1);
    auto dq_out = [&](const float (&dq)[32], int u) {
        if (ZERO) mbar_wait(&zero_ready[u], 0);  // (main_zeroes form) before the reductions into tile kb + u
        __syncwarp();
        if (lane == 0) mbar_arrive(&ds_empty[u % DS_RING]);
        if (tid == 0) bulk_wait_read_att();  // the previous tile's reductions have read the staging buffer
        wg_barrier(1 + cw);
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const uint32_t a = st0 + (j >> 2) * 8192 + hh * 8 * 128 + (((2 * (j & 3) + (t >> 1)) ^ g) << 4);
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(a), "f"(dq[4 * j + 2 * hh]),
                             "f"(dq[4 * j + 2 * hh + 1]) : "memory");
            }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        wg_barrier(1 + cw);
        if (tid == 0) {
            const int row = (kb + u) * BQ + 64 * cw;
            unsigned char* sb = sdq + cw * DQ_STAGE_BYTES;
            tma_reduce_add_3d(tm + 2, sb, 0, row, bh);
            tma_reduce_add_3d(tm + 2, sb + 8192, 32, row, bh);
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
    };
    if (tid == 0) tensormap_acquire(tm + 2);
    turn.start();
    for (int i = 0; i < nt; i++) {
        float* r = myrows + (i & 1) * ROWS_FLOATS;  // this tile's lse, D (staged by dkdv_tile_scores)
        const unsigned char* sqt = dkdv_tile_scores<V5_STAGES>(sc, dp, r, l_next, d_next, load_rows, i, nt, tid, cw, sqd,
                                                               full, skw, svw, turn);
        const int q0 = (kb + i) * BQ;
        if (i == 0 || i == nt - 1) mask_scores_t<16>(sc, q0 + 2 * t - key0, T - q0 - 2 * t);
        // P^T, dS^T as variant 4; each dS^T pair goes to shared memory as soon as it is formed (dS^T
        // is read from there by dk's and dq's products; fewer registers live than packing it first):
        // keys key0 + 8 hh, queries 8j + 2t, +1 of the tile: half j / 8, chunk j % 8 of the key's
        // 128-byte row, stored at chunk (j % 8) ^ g (row % 8 = g). Ring slot i % DS_RING: free once
        // both consumers' dq products of tile i - DS_RING have completed.
        unsigned char* dsb = sds + (i % DS_RING) * DS_BYTES;
        mbar_wait(&ds_empty[i % DS_RING], ((i / DS_RING) & 1) ^ 1);
        const uint32_t ds0 = smem_u32(dsb) + (key0 - k0) * ROW_BYTES + 4 * t;  // row key0 - k0, chunk 0
#pragma unroll
        for (int j = 0; j < 16; j++) {
            const float2 lq = *reinterpret_cast<const float2*>(r + 8 * j + 2 * t);
            const float2 dd = *reinterpret_cast<const float2*>(r + BQ + 8 * j + 2 * t);
            float ds[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = e & 1;
                const float p = ex2(fmaf(sc[4 * j + e], c2, -(c ? lq.y : lq.x)));  // masked: 2^-inf = +0
                sc[4 * j + e] = p;
                ds[e] = p * (dp[4 * j + e] - (c ? dd.y : dd.x));
            }
            const uint32_t a = ds0 + (j >> 3) * DS_HALF_BYTES + (((j & 7) ^ g) << 4);
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(a), "r"(pack_bf16(ds[0], ds[1])) : "memory");
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(a + 8 * ROW_BYTES), "r"(pack_bf16(ds[2], ds[3])) : "memory");
        }
        pack_a(pa, sc);
        // the generic-proxy stores, before the wgmma (async proxy) reads them: this warpgroup's rows for
        // its dk product (a barrier of the warpgroup), both consumers' for the dq products (ds_full)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncwarp();
        if (lane == 0) mbar_arrive(&ds_full[i % DS_RING]);
        wg_barrier(1 + cw);
        // dq one tile behind: tile i - 1's dS^T was finished by the other consumer long ago (it runs
        // at most about half a tile behind), so this wait does not put the two in lockstep
        if (i > 0) mbar_wait(&ds_full[(i - 1) % DS_RING], ((i - 1) / DS_RING) & 1);
        float dq[32];  // (zeroed: at i = 0 no product writes it; left undefined there, ptxas spills)
#pragma unroll
        for (int z = 0; z < 32; z++) dq[z] = 0.0f;
        turn.begin();
        // dv += P^T dout; dk += dS^T q with A = this consumer's 64 key rows of the stored dS^T (K-major:
        // k-step kk is queries 16 kk.., 32 bytes into the rows of half kk / 4); then tile i - 1's dq. Three
        // arms, each from its fence to its wait: consumer 1's diagonal tile (i = 0: queries 64..127 only,
        // k-steps 4..7; no dq yet), consumer 0's turn with the diagonal tile's dq (i = 1: keys 0..63 only),
        // and the rest (ATT_DIAG_SKIP above)
        auto dv_dk = [&](int kk0) {
#pragma unroll
            for (int kk = kk0; kk < 8; kk++) wgmma_bf16_rs_n64<1>(dv, pa[kk], desc_mn(sqt + KV_BYTES + kk * 2048), 1);
#pragma unroll
            for (int kk = kk0; kk < 8; kk++)
                wgmma_bf16_n64<0, 1>(dk, desc_k(dsb + (kk >> 2) * DS_HALF_BYTES + cw * 64 * ROW_BYTES + 32 * (kk & 3)),
                                     desc_mn(sqt + kk * 2048), 1);
        };
        if (ATT_DIAG_SKIP && i == 0 && cw == 1) {
            wgmma_fence();
            dv_dk(4);
            wgmma_commit();
            turn.end(false);
            wgmma_wait<0>();
        } else if (ATT_DIAG_SKIP && i == 1 && cw == 0) {
            wgmma_fence();
            dv_dk(0);
            issue_dq_diag_lo(dq);
            wgmma_commit();
            turn.end(false);
            wgmma_wait<0>();
        } else {
            wgmma_fence();
            dv_dk(0);
            if (i > 0) issue_dq(dq, i - 1);
            wgmma_commit();
            turn.end(false);
            wgmma_wait<0>();
        }
        keep_in_regs(dv);
        keep_in_regs(dk);
        keep_in_regs(dq);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[i % V5_STAGES]);
        if (i > 0) dq_out(dq, i - 1);
    }
    {  // the last tile's dq: one more turn each
        mbar_wait(&ds_full[(nt - 1) % DS_RING], ((nt - 1) / DS_RING) & 1);
        float dq[32];
        turn.begin();
        if (ATT_DIAG_SKIP && nt == 1 && cw == 0) {  // (the diagonal tile's dq: keys 0..63 only)
            wgmma_fence();
            issue_dq_diag_lo(dq);
            wgmma_commit();
            turn.end(true);
            wgmma_wait<0>();
        } else {
            wgmma_fence();
            issue_dq(dq, nt - 1);
            wgmma_commit();
            turn.end(true);
            wgmma_wait<0>();
        }
        keep_in_regs(dq);
        dq_out(dq, nt - 1);
        // the staged dq rows read before the CTA exits (the reductions complete with the grid)
        if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }

    // (colsum form) this warpgroup's 64 keys' row of partials: dk's and dv's column sums (keys past T: none)
    const int k64 = k0 + 64 * cw;
    float* prow = part != nullptr && k64 < T ? part + ((size_t)b * ((T + 63) / 64) + k64 / 64) * 3 * C : nullptr;
    store_dkdv(dinp, dk, dv, const_cast<unsigned char*>(svw), b, h, T, C, k64, tid, cw, scale, prow);
}

// The main kernel's entry points: flash_attention_backward_dkdvq_kernel5_bf16<SFX>(BWD5_DKDVQ_PARAMS) runs
// flash_backward_dkdvq_wgmma<BTC[, PINGPONG[, ZERO]]> on them and zs: nullptr, but in the _mz builds
// (BWD5_DKDVQ_MZ), which take zs as a last parameter.
// part: the colsum form's partials (B ceil(T / 64), 3C) fp32, or nullptr
#define BWD5_DKDVQ_PARAMS                                                                                        \
    bf16* dinp, float* dq_acc, const CUtensorMap* tm, const float* lse, const float* Dbuf, int B, int NH, int T, \
        float scale, int G, float* part
#define BWD5_DKDVQ(SFX, ...)                                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                     \
    flash_attention_backward_dkdvq_kernel5_bf16##SFX(BWD5_DKDVQ_PARAMS) {                                        \
        LLMC_PDL_WAIT();                                                                                         \
        flash_backward_dkdvq_wgmma<__VA_ARGS__>(dinp, dq_acc, tm, lse, Dbuf, B, NH, T, scale, G, part, nullptr); \
    }
#define BWD5_DKDVQ_MZ(SFX, ...)                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                \
    flash_attention_backward_dkdvq_kernel5_bf16##SFX(BWD5_DKDVQ_PARAMS, unsigned* zs) {                     \
        LLMC_PDL_WAIT();                                                                                    \
        flash_backward_dkdvq_wgmma<__VA_ARGS__>(dinp, dq_acc, tm, lse, Dbuf, B, NH, T, scale, G, part, zs); \
    }
BWD5_DKDVQ(, false)
BWD5_DKDVQ(_btc, true)
BWD5_DKDVQ(_btc_pingpong, true, true)
// the main_zeroes form (in place only): zs, the sync words (2 a head, zero between launches)
BWD5_DKDVQ_MZ(_btc_mz, true, false, true)
BWD5_DKDVQ_MZ(_btc_pingpong_mz, true, true, true)

// The colsum form's last two passes (attention_backward 5 with colsum=True: dbias(3C) += the column
// sums of dinp viewed as (B T, 3C), qkv's bias gradient, without matmul_backward_bias re-reading dinp).
// The main kernel wrote the dk and dv columns of part's rows (a row per 64 keys of a batch row, the
// sums of the bf16 values as stored). convert_colsum: convert's work (dinp[..., 0:C] = bf16(scale
// dq_acc)) by a block per (b, 64 rows): thread (x, y) converts columns 8x..8x+7 of rows y, y + RG, ...
// and sums the values it stores; the RG row groups' sums are added in order (y = 0, 1, ...) through
// shared memory ((RG - 1) C floats, dynamic) into the q columns of the block's row of part.
template <int RG>
__device__ __forceinline__ void convert_colsum_t(bf16* __restrict__ dinp, float* __restrict__ part,
                                                 const float* __restrict__ dq_acc, int B, int NH, int T, float scale) {
    extern __shared__ float red[];  // [RG - 1][C]
    const int C = NH * HS, nq64 = (T + 63) / 64;
    const int b = blockIdx.x / nq64, t64 = blockIdx.x % nq64;
    const int c = 8 * threadIdx.x, h = c / HS, d = c % HS, y = threadIdx.y;
    const float* src = dq_acc + (size_t)(b * NH + h) * T * HS + d;
    float s[8];
#pragma unroll
    for (int e = 0; e < 8; e++) s[e] = 0.0f;
    // rows 4 at a time: their loads issued, then converted, stored and summed in row order
#pragma unroll
    for (int i0 = 0; i0 < 64 / RG; i0 += 4) {
        float4 ld[4][2];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = t64 * 64 + y + RG * (i0 + i);
            if (t < T) {
                ld[i][0] = *reinterpret_cast<const float4*>(src + (size_t)t * HS);
                ld[i][1] = *reinterpret_cast<const float4*>(src + (size_t)t * HS + 4);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = t64 * 64 + y + RG * (i0 + i);
            if (t >= T) continue;
            const float4 a = ld[i][0], a2 = ld[i][1];
            uint4 o;
            o.x = pack_bf16(a.x * scale, a.y * scale);
            o.y = pack_bf16(a.z * scale, a.w * scale);
            o.z = pack_bf16(a2.x * scale, a2.y * scale);
            o.w = pack_bf16(a2.z * scale, a2.w * scale);
            *reinterpret_cast<uint4*>(dinp + ((size_t)b * T + t) * 3 * C + c) = o;
            s[0] += unpack_lo(o.x); s[1] += unpack_hi(o.x); s[2] += unpack_lo(o.y); s[3] += unpack_hi(o.y);
            s[4] += unpack_lo(o.z); s[5] += unpack_hi(o.z); s[6] += unpack_lo(o.w); s[7] += unpack_hi(o.w);
        }
    }
    if (y > 0) {
#pragma unroll
        for (int e = 0; e < 8; e++) red[(y - 1) * C + c + e] = s[e];
    }
    __syncthreads();
    if (y == 0) {
        for (int k = 0; k < RG - 1; k++) {
#pragma unroll
            for (int e = 0; e < 8; e++) s[e] += red[k * C + c + e];
        }
        float* dst = part + ((size_t)b * nq64 + t64) * 3 * C + c;
        *reinterpret_cast<float4*>(dst) = make_float4(s[0], s[1], s[2], s[3]);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(s[4], s[5], s[6], s[7]);
    }
}
// RG = 8 where 8 C / 8 threads fit a block (C <= 1024), else 4 (C <= 2048; the build refuses more)
#define CONVERT_COLSUM5(RG)                                                                                         \
    extern "C" __global__ void __launch_bounds__(1024) flash_attention_backward_convert_colsum_kernel5_bf16_rg##RG( \
        bf16* dinp, float* part, const float* dq_acc, int B, int NH, int T, float scale) {                          \
        LLMC_PDL_WAIT();                                                                                            \
        convert_colsum_t<RG>(dinp, part, dq_acc, B, NH, T, scale);                                                  \
    }
CONVERT_COLSUM5(8)
CONVERT_COLSUM5(4)

// finish: dbias[c] = dbias[c] + the sum of part's R rows, rounded once (bf16, or fp32 for the TF32 build's
// dbias). Block (FINISH_X, 64): thread x takes 4 columns (a float4), thread y rows y, y + 64, ... (R / 64 of
// them: all its loads in flight at once); the 64 partial sums then added pairwise through shared memory (y +=
// y + 32, + 16, ...): a fixed order, whatever FINISH_X is. 3C % 4 == 0 (C = 64 NH). (A first form, 16 row
// groups summed in a loop, took 6.6 us at d12 B=16.) Returns, in thread y = 0, its 4 columns' sums (c < C3
// only: else zeros).
// The finish kernels read dbias before the sums (session 56): read after them, its load's latency came
// after the partials' and the tree's, and the kernel took 0.0050 ms at d12 B=4 against a 0.0040 ms copy of
// its bytes (79%). FINISH_X was 16 until session 57: 8 (twice the blocks, half the warps at each of the
// tree's six barriers) took d12 B=4's finish from 4.58-4.64 us to 4.42-4.48 against a 3.81-3.89 us copy, and
// was level or faster at 256 and 1024 rows; 4 was as fast at B=4 in one call, slower in the next, and up to
// 4% slower at 1024 rows. Two forms with fewer threads, each holding several y (levels in registers, then
// shuffles or one barrier), were slower at every R (docs/ops.md).
#ifndef FINISH_X
#define FINISH_X 8
#endif
__device__ __forceinline__ float4 colsum_finish_rows(const float* part, int R, int C3, int c) {
    __shared__ float4 red[64][FINISH_X];
    const int x = threadIdx.x, y = threadIdx.y;
    float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (c < C3) {
#pragma unroll 8
        for (int r = y; r < R; r += 64) {
            const float4 v = *reinterpret_cast<const float4*>(part + (size_t)r * C3 + c);
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
    }
    red[y][x] = s;
#pragma unroll
    for (int h = 32; h > 0; h >>= 1) {
        __syncthreads();
        if (y < h) {
            const float4 v = red[y + h][x];
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
            red[y][x] = s;
        }
    }
    return s;
}

extern "C" __global__ void __launch_bounds__(64 * FINISH_X)
flash_attention_backward_colsum_finish_kernel_bf16(bf16* dbias, const float* part, int R, int C3) {
    LLMC_PDL_WAIT();
    const int c = 4 * (blockIdx.x * FINISH_X + threadIdx.x);
    const bool mine = threadIdx.y == 0 && c < C3;
    uint2 w = make_uint2(0u, 0u);
    if (mine) w = *reinterpret_cast<const uint2*>(dbias + c);  // (before the sums: see above)
    const float4 s = colsum_finish_rows(part, R, C3, c);
    if (mine) {
        w.x = pack_bf16(unpack_lo(w.x) + s.x, unpack_hi(w.x) + s.y);
        w.y = pack_bf16(unpack_lo(w.y) + s.z, unpack_hi(w.y) + s.w);
        *reinterpret_cast<uint2*>(dbias + c) = w;
    }
}

// the TF32 build's finish (attention_backward 4 fp32, colsum form): dbias fp32, 16-byte aligned
extern "C" __global__ void __launch_bounds__(64 * FINISH_X)
flash_attention_backward_colsum_finish_kernel_fp32(float* dbias, const float* part, int R, int C3) {
    LLMC_PDL_WAIT();
    const int c = 4 * (blockIdx.x * FINISH_X + threadIdx.x);
    const bool mine = threadIdx.y == 0 && c < C3;
    float4 w = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (mine) w = *reinterpret_cast<const float4*>(dbias + c);  // (as the bf16 build: before the sums)
    const float4 s = colsum_finish_rows(part, R, C3, c);
    if (mine) {
        w.x += s.x; w.y += s.y; w.z += s.z; w.w += s.w;
        *reinterpret_cast<float4*>(dbias + c) = w;
    }
}

// ------------------------------------------------------------------------------------------------
// The TF32 forward (fp32 in and out; attention_forward 4's fp32 build, the fp32 default on Hopper).
// Written without a GPU in session 10, tested and measured on the H100 in session 11 (docs/ops.md).
//
// TF32 wgmma reads both shared-memory operands K-major only (no transpose immediates), so:
//   S = q k^T    A = q (64 rows x 64 dims), B = k (128 keys x 64 dims): both K-major (dims contiguous),
//                each row 256 bytes, held as two 128-byte-swizzled halves (dims 0-31, 32-63): k-step
//                ks (8 dims) is half ks / 4, +32 bytes per step inside it, as in GEMM engine 5's tf32.
//   O += P v     A = P from registers (the scores' accumulators), B = v^T (64 dims x 128 keys, keys
//                contiguous): a K-major v needs v transposed in global memory, which
//                attention_vt_kernel writes from qkvr's v before the forward (vt, (B NH, 64, Tp)).
// P from registers without shuffles: a tf32 A fragment of k-step j holds, per thread, rows g and g+8
// of columns t and t+4 (g = lane/4, t = lane%4), while the scores' accumulators hold columns 2t and
// 2t+1 of keys 8j..8j+7. A product over k does not care in which order its k run, as long as A's
// columns and B's rows agree: so A's column t is key 8j + 2t and its column t + 4 key 8j + 2t + 1, and
// vt stores each group of 8 keys in that order (position t <- key 2t, position t + 4 <- key 2t + 1;
// vt_pos below). Tp = T rounded up to 8, keys T..Tp-1 stored as zeros (their p is 0: no NaN can
// come in from padding). P is rounded to tf32 (cvt.rna) before the product; q, k, v are rounded by
// the TMA as they are copied (the TFLOAT32 data type of the tensor maps).
//
// One CTA per (b, h, 128 query rows), as the bf16 plain kernel: a producer warpgroup loading q once
// and k, vt tiles into a 2-stage ring, two consumer warpgroups of 64 query rows each, the online
// softmax of the bf16 kernel (softmax_tile, rescale_o: the accumulator layouts are the same), out
// and lse stored as attention_forward 2/3 do (lse (B,NH,T) in natural-log units, read by backward 2/3).
constexpr int TF_ROW = 128;                          // bytes per swizzled row: 32 fp32
constexpr int TF_Q_HALF = 64 * TF_ROW;               // 64 query rows x 32 dims: 8 KB
constexpr int TF_Q_BYTES = 2 * 2 * TF_Q_HALF;        // 2 consumers x 2 halves: 32 KB
constexpr int TF_K_HALF = BKV * TF_ROW;              // 128 keys x 32 dims: 16 KB
constexpr int TF_VT_BOX = 64 * TF_ROW;               // 64 dims x 32 keys: 8 KB
constexpr int TF_STAGE = 2 * TF_K_HALF + 4 * TF_VT_BOX;  // k (2 halves) then vt (4 boxes): 64 KB
constexpr int TF_STAGE_SMT = TF_STAGE + 2 * TF_K_HALF;      // SMT: + the v tile (2 halves) vt is made from: 96 KB
constexpr int TF_FWD_SMEM = 1024 + TF_Q_BYTES + STAGES * TF_STAGE + 8 * (2 + 3 * STAGES);
constexpr int TF_FWD_SMEM_SMT = 1024 + TF_Q_BYTES + STAGES * TF_STAGE_SMT + 8 * (2 + 3 * STAGES);
static_assert(TF_FWD_SMEM < TF_FWD_SMEM_SMT && TF_FWD_SMEM_SMT <= 227 * 1024, "fits one SM's shared memory");

// the position of key k in vt's rows (see above)
__device__ __forceinline__ int vt_pos(int k) { return (k & ~7) | ((k & 1) << 2) | ((k & 7) >> 1); }

// dst (BNH, 64, Tp) = x^T with each group of 8 rows (keys or queries) in vt_pos order, zeros past T,
// for x = v, k, q of qkvr ((B, NH, T, 64): head stride T*64, row stride 64, batch stride NH*T*64), of
// the qkv matmul's output in place ((B, T, 3C) from the part's first column: head stride 64, row
// stride 3C, batch stride 3TC) or dout ((B, T, C): 64, C, TC). Block (32, 8): 32 rows x 64 dims of one
// head through shared memory (both sides coalesced).
extern "C" __global__ void attention_vt_kernel(float* dst, const float* x, int NH, int T, int Tp, int head_stride,
                                               int row_stride, long long batch_stride) {
    LLMC_PDL_WAIT();
    __shared__ float tile[32][HS + 1];
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH, k0 = blockIdx.x * 32, tx = threadIdx.x, ty = threadIdx.y;
    const float* src = x + (size_t)b * batch_stride + (size_t)h * head_stride;
    for (int r = ty; r < 32; r += 8) {
        const int k = k0 + r;
        tile[r][tx] = k < T ? src[(size_t)k * row_stride + tx] : 0.0f;
        tile[r][tx + 32] = k < T ? src[(size_t)k * row_stride + tx + 32] : 0.0f;
    }
    __syncthreads();
    const int k = k0 + tx, p = vt_pos(k);
    if (p >= Tp) return;  // (k < Tp iff p < Tp: a group of 8 is all in or all out)
    float* out = dst + (size_t)bh * HS * Tp;
    for (int d = ty; d < HS; d += 8) out[(size_t)d * Tp + p] = tile[tx][d];
}

__device__ __forceinline__ uint32_t to_tf32(float x) {  // round to nearest (ties away), tf32 in an fp32 register
    uint32_t y;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(y) : "f"(x));
    return y;
}

// A box of rows (row0 ..) of part `part` (0 q, 1 k, 2 v) of head h, batch b, dims d0 .. d0 + 31, by the
// TMA: from qkvr (B, NH, T, 64) each part, seen as 3D (64 dims, T, 3 B NH slabs), or with BTC from the
// qkv matmul's output in place (B, T, 3C), seen as 4D (64 dims, 3 NH heads, T, B). Either box lands as
// the same rows of 128 swizzled bytes.
template <bool BTC>
__device__ __forceinline__ void tma_load_part(void* dst, const CUtensorMap* tm, uint64_t* bar, int d0, int row0, int part,
                                              int b, int h, int B, int NH) {
    if constexpr (BTC)
        tma_load_4d(dst, tm, bar, d0, part * NH + h, row0, b);
    else
        tma_load_3d(dst, tm, bar, d0, row0, (part * B + b) * NH + h);
}

// SMT (shared-memory transposes, forward and backward): instead of attention_vt_kernel's pass over
// global memory and a TMA load of each transposed tile, the producer warpgroup's three idle warps (96
// threads) write a stage's transposed tiles from the tiles the TMA just brought into the same stage,
// then arrive on the stage's `full` barrier (3 arrivals besides the producer's; the TMA itself
// completes `tfull`). A transposed tile of NPOS positions has the layout the TMA gave from global
// memory: NPOS / 32 boxes of 64 dim rows x 32 positions (8 KB, 128-byte swizzled), each group of 8
// positions in vt_pos order; its source is two halves (dims 0-31, 32-63) of NPOS position rows x 32
// dims. Values as the TMA rounded them to tf32 (the same bits as the global transposes).
__device__ __forceinline__ uint32_t sw128(int row, int col) {  // byte offset of fp32 (row, col) in a half
    return row * 128 + ((((col >> 2) ^ (row & 7)) << 4) | ((col & 3) << 2));
}

// (NT tiles of NPOS x 64 fp32: dst + j NPOS 256 bytes from src + j NPOS 256, j < NT, in one loop,
// two chunks at a time so that 8 loads are in flight. Shared-space addresses in 32 bits: the producer
// warpgroup of an SMT kernel runs on TF_SMT_PRODUCER_REGS registers, its consumers on
// TF_SMT_CONSUMER_REGS: 40 and 224, the pair without spills (on 24 or 32 registers the two chunks
// spill; four chunks on 56 leave the consumers 216, and they spill).)
constexpr int TF_SMT_PRODUCER_REGS = 40, TF_SMT_CONSUMER_REGS = 224;
static_assert(128 * TF_SMT_PRODUCER_REGS + 256 * TF_SMT_CONSUMER_REGS <= 65536, "one SM's register file");
__device__ __forceinline__ float lds_f32(uint32_t a) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a));
    return v;
}

template <int NPOS, int NT>
__device__ __forceinline__ void transpose_tiles_tf32(unsigned char* dst, const unsigned char* src, int t) {
    constexpr int TILE = NPOS * 256, BOXES = NPOS / 32, PER_TILE = BOXES * 64 * 8;  // 16-byte chunks a tile
    const uint32_t d0 = smem_u32(dst), s0 = smem_u32(src);
#pragma unroll 2
    for (int c = t; c < NT * PER_TILE; c += 96) {
        const int j = NT == 1 ? 0 : c / PER_TILE, cc = NT == 1 ? c : c % PER_TILE;
        const int box = cc >> 9, d = (cc >> 3) & 63, q4 = cc & 7;    // dst box, dim row, 16-byte chunk (4 positions)
        const int key0 = 32 * box + 8 * (q4 >> 1) + (q4 & 1);       // its positions hold rows key0, +2, +4, +6
        const uint32_t sh = s0 + j * TILE + (d >> 5) * (NPOS * 128);
        const float x = lds_f32(sh + sw128(key0, d & 31)), y = lds_f32(sh + sw128(key0 + 2, d & 31));
        const float z = lds_f32(sh + sw128(key0 + 4, d & 31)), w = lds_f32(sh + sw128(key0 + 6, d & 31));
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(d0 + j * TILE + box * 8192 + sw128(d, 4 * q4)),
                     "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
    }
}

// the transposing warps' hand-over: their generic-proxy stores become visible to wgmma (async proxy),
// then one arrival per warp on the stage's full barrier
__device__ __forceinline__ void transposed(uint64_t* full) {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(full);
}

// maps: 3 consecutive CUtensorMaps in global memory: q rows (qkvr's q, box 32 dims x 64 rows), k rows
// (qkvr's k, box 32 x 128; with SMT also v's rows), vt (box 32 keys x 64 dims; not with SMT); out (B,T,C)
// fp32, lse (B,NH,T) fp32.
// PERSIST: one CTA per SM walking (b, h, query block) items as the bf16 persistent kernel does
// (persistent_item: the blocks with the most key tiles first, snake order across CTAs); the k/v ring
// (and SMT's transposes) run on across items, and q's one buffer is freed (q_empty, one arrival per
// consumer warp) once an item's last q k^T has completed, so the producer loads the next item's q
// while the consumers finish this one. Not PERSIST: the grid is (B NH, query blocks), one item a CTA.
// Both run the same loop and give the same bits.
template <bool BTC, bool SMT, bool PP = false, bool PERSIST = false>
__device__ __forceinline__ void flash_forward_wgmma_tf32(float* out, float* lse, const CUtensorMap* maps, int B, int NH,
                                                         int T, float scale) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    unsigned char* sq = smem;                    // consumer cw: half hf at sq + cw * 2 TF_Q_HALF + hf * TF_Q_HALF
    constexpr int STAGE = SMT ? TF_STAGE_SMT : TF_STAGE;
    unsigned char* skv = smem + TF_Q_BYTES;      // stage s: k halves, then vt boxes, [SMT: then v halves]
    uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + TF_Q_BYTES + STAGES * STAGE);
    uint64_t* full = q_full + 1;
    uint64_t* empty = full + STAGES;
    uint64_t* tfull = empty + STAGES;            // SMT: the TMA's part of a stage has landed
    uint64_t* q_empty = tfull + STAGES;          // q's buffer free again (the next item's q may come)
    const CUtensorMap* tq = maps;
    const CUtensorMap* tk = maps + 1;
    const CUtensorMap* tv = maps + 2;
    const int BNH = B * NH, nqb = (T + BQ - 1) / BQ;
    // item r of this CTA: head bh, query block qb (key tiles 0..qb; tile qb holds the diagonal)
    auto item = [&](int r, int& bh, int& qb) -> bool {
        if (!PERSIST) {
            bh = blockIdx.x;
            qb = gridDim.y - 1 - blockIdx.y;  // the query blocks with the most key tiles first
            return r == 0;
        }
        const int w = persistent_item(r);
        qb = nqb - 1 - w / BNH;
        bh = w % BNH;
        return w < BNH * nqb;
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) mbar_init(&tfull[s], 1);
        mbar_init(q_empty, CONSUMER_WARPS);
        mbar_init_pipeline(q_full, full, empty, STAGES, CONSUMER_WARPS, SMT ? 3 : 1);
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(SMT ? TF_SMT_PRODUCER_REGS : 24) : "memory");
        if (SMT && threadIdx.x >= 32) {  // warps 1-3: vt of each stage from its v tile
            int u = 0;  // ring slot of the next k/v tile
            for (int r = 0;; r++) {
                int bh, qb;
                if (!item(r, bh, qb)) break;
                for (int i = 0; i <= qb; i++, u++) {
                    const int s = u % STAGES;
                    mbar_wait(&tfull[s], (u / STAGES) & 1);
                    unsigned char* st = skv + s * STAGE;
                    transpose_tiles_tf32<BKV, 1>(st + 2 * TF_K_HALF, st + TF_STAGE, threadIdx.x - 32);
                    transposed(&full[s]);
                }
            }
        }
        if (threadIdx.x == 0) {
            tensormap_acquire(tq);
            tensormap_acquire(tk);
            if (!SMT) tensormap_acquire(tv);
            int u = 0;
            for (int r = 0;; r++) {
                int bh, qb;
                if (!item(r, bh, qb)) break;
                const int b = bh / NH, h = bh % NH, q0 = qb * BQ;
                mbar_wait(q_empty, (r & 1) ^ 1);  // (item 0: a fresh barrier's "previous phase" passes)
                mbar_expect_tx(q_full, TF_Q_BYTES);
#pragma unroll
                for (int cw = 0; cw < 2; cw++)
#pragma unroll
                    for (int hf = 0; hf < 2; hf++)
                        tma_load_part<BTC>(sq + (2 * cw + hf) * TF_Q_HALF, tq, q_full, 32 * hf, q0 + 64 * cw, 0, b, h, B,
                                           NH);
                for (int i = 0; i <= qb; i++, u++) {
                    const int s = u % STAGES, use = u / STAGES;
                    mbar_wait(&empty[s], (use & 1) ^ 1);
                    uint64_t* bar = SMT ? &tfull[s] : &full[s];
                    mbar_expect_tx(bar, SMT ? 4 * TF_K_HALF : TF_STAGE);  // SMT: k and v; else k and vt
                    unsigned char* st = skv + s * STAGE;
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        tma_load_part<BTC>(st + hf * TF_K_HALF, tk, bar, 32 * hf, i * BKV, 1, b, h, B, NH);
                        if (SMT)
                            tma_load_part<BTC>(st + TF_STAGE + hf * TF_K_HALF, tk, bar, 32 * hf, i * BKV, 2, b, h, B, NH);
                    }
                    if (!SMT) {
#pragma unroll
                        for (int c = 0; c < 4; c++)
                            tma_load_3d(st + 2 * TF_K_HALF + c * TF_VT_BOX, tv, bar, i * BKV + 32 * c, 0, bh);
                    }
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(SMT ? TF_SMT_CONSUMER_REGS : 240) : "memory");

    const int cw = wg - 1;  // consumer: query rows 64 cw .. 64 cw + 63 of the block
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const float c2 = scale * LOG2E;                 // scores -> log2 units
    const unsigned char* sqw = sq + cw * 2 * TF_Q_HALF;
    const PingPong<PP> turn{cw};  // PP: the consumers take turns issuing (2 nkt turns an item each), as the bf16 kernels
    int u = 0;                    // ring slot of the next k/v tile
    for (int r = 0;; r++) {
        int bh, qb;
        if (!item(r, bh, qb)) break;
        const int b = bh / NH, h = bh % NH, nkt = qb + 1;
        const int row0 = qb * BQ + 64 * cw + 16 * warp + g;  // this thread's rows: row0 (h = 0), row0 + 8 (h = 1)

        float o[32];
#pragma unroll
        for (int i = 0; i < 32; i++) o[i] = 0.0f;
        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
        float sc[64];
        float corr[2];
        turn.start();

        mbar_wait(q_full, r & 1);
        for (int i = 0; i < nkt; i++, u++) {
            const unsigned char* st = skv + (u % STAGES) * STAGE;
            mbar_wait(&full[u % STAGES], (u / STAGES) & 1);
            turn.begin();
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < HS / 8; ks++)  // 8 k-steps of 8 dims: half ks / 4, 32 bytes a step inside it
                wgmma_tf32_n128(sc, desc_k(sqw + (ks >> 2) * TF_Q_HALF + 32 * (ks & 3)),
                                desc_k(st + (ks >> 2) * TF_K_HALF + 32 * (ks & 3)), ks > 0);
            wgmma_commit();
            turn.end(false);
            wgmma_wait<0>();
            keep_in_regs(sc);
            if (i == nkt - 1) {  // the item's last read of q: its buffer may take the next item's q
                __syncwarp();
                if (lane == 0) mbar_arrive(q_empty);
            }
            softmax_tile(sc, m, l, corr, i == nkt - 1, i * BKV, row0, t, c2);
            rescale_o(o, corr);
            uint32_t pa[BKV / 8][4];  // k-step j: rows g, g+8 of keys 8j + 2t (columns t) and 8j + 2t + 1 (t + 4)
#pragma unroll
            for (int j = 0; j < BKV / 8; j++) {
                pa[j][0] = to_tf32(sc[4 * j]);
                pa[j][1] = to_tf32(sc[4 * j + 2]);
                pa[j][2] = to_tf32(sc[4 * j + 1]);
                pa[j][3] = to_tf32(sc[4 * j + 3]);
            }
            turn.begin();
            wgmma_fence();
#pragma unroll
            for (int j = 0; j < BKV / 8; j++)  // keys 8j..8j+7: vt box j / 4, 32 bytes a step inside it
                wgmma_tf32_rs_n64(o, pa[j], desc_k(st + 2 * TF_K_HALF + (j >> 2) * TF_VT_BOX + 32 * (j & 3)), 1);
            wgmma_commit();
            turn.end(i == nkt - 1);
            wgmma_wait<0>();  // also: P's registers may be reused only after this
            keep_in_regs(o);
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[u % STAGES]);
        }

        forward_store(out, lse, o, m, l, row0, t, b, h, NH, T);  // out = O / l, lse = (m + log2 l) ln 2
    }
}

// The four layouts of the TF32 kernels (forward, dq, dk/dv), M(name suffix, BTC, SMT) each: q, k, v from
// qkvr or in place (_btc), v transposed by attention_vt_kernel or in shared memory (_smt)
#define TF32_LAYOUTS(M) M(, false, false) M(_smt, false, true) M(_btc, true, false) M(_btc_smt, true, true)
// flash_attention_forward_kernel4_tf32<SFX>: flash_forward_wgmma_tf32<BTC, SMT[, PP[, PERSIST]]> (FWD4_ENTRY)
#define FWD4_TF32(SFX, ...)                                                                             \
    FWD4_ENTRY(flash_attention_forward_kernel4_tf32##SFX, float, flash_forward_wgmma_tf32, __VA_ARGS__)
// _smt: v transposed in shared memory (SMT) instead of by attention_vt_kernel; _btc: q, k from the qkv
// matmul's output in place (maps[0], [1]: 4D, boxes (32, 1, 64 or 128, 1))
TF32_LAYOUTS(FWD4_TF32)
// in place, the consumers taking turns issuing (_pp; with v transposed globally or in shared memory)
FWD4_TF32(_btc_pp, true, false, true)
FWD4_TF32(_btc_smt_pp, true, true, true)
// persistent (grid: one CTA per SM, at most one per item), in place, taking turns
FWD4_TF32(_btc_pp_persistent, true, false, true, true)
FWD4_TF32(_btc_smt_pp_persistent, true, true, true, true)

// ------------------------------------------------------------------------------------------------
// The TF32 backward (attention_backward 4's fp32 build): the two kernels of the bf16 backward above
// in TF32 (written in session 10, tested and measured on the H100 in session 11).
//
// In fp32 a 128-row tile is 32 KB, and every O-shape product needs its B transposed (TF32 wgmma reads
// K-major shared memory only): dq += dS k needs k^T, dv += P^T dout needs dout^T, dk += dS^T q needs
// q^T, each over the contracted positions in vt_pos order (the forward's trick: the S-shape
// accumulators are the register A). Those come from attention_vt_kernel into scratch buffers (kt, qt,
// dot: (B NH, 64, Tp)). So the swept tiles are 64 rows (k, v, kt: 48 KB a stage in dq; q, dout, qt,
// dot: 64 KB in dk/dv), two stages, and the S-shapes are m64n64:
//   dq kernel, CTA (bh, 128 query rows), key tiles of 64, 0 .. 2 qb + 1 (the last two hold the diagonal):
//     S = q k^T, dP = dout v^T (m64n64 each), dS = P (dP - D), dq += dS k (B = kt's tile)
//   dkdv kernel, CTA (bh, 128 keys), query tiles of 64 from the key block's first query on:
//     S^T = k q^T, dP^T = v dout^T, P^T, dS^T per query column (lse, D staged per tile),
//     dv += P^T dout (B = dot's tile), dk += dS^T q (B = qt's tile)
// Everything else as in the bf16 kernels: D = rowsum(dout * out) written by the dq kernel (fp32
// here), lse read in log2 units, no atomics, zero-filled rows past T masked.
constexpr int TB_ROWS = 64;                              // rows of a swept tile
constexpr int TB_HALF = TB_ROWS * TF_ROW;                // 64 rows x 32 fp32: 8 KB (a 128-byte-wide half)
constexpr int TB_TILE = 2 * TB_HALF;                     // 64 rows x 64 fp32: 16 KB
constexpr int TB_RES = 2 * TB_TILE;                      // a resident 128-row tile: 32 KB
constexpr int TB_DQ_STAGE = 3 * TB_TILE;                 // k, v, kt
constexpr int TB_DKDV_STAGE = 4 * TB_TILE;               // q, dout, qt, dot
constexpr int TB_DQ_SMEM = 1024 + 2 * TB_RES + BWD_STAGES * TB_DQ_STAGE + 8 * (1 + 3 * BWD_STAGES);
constexpr int TB_DKDV_SMEM = 1024 + 2 * TB_RES + BWD_STAGES * TB_DKDV_STAGE + 2 * 2 * 2 * TB_ROWS * 4 +
                             8 * (1 + 3 * BWD_STAGES);
static_assert(TB_DQ_SMEM <= 227 * 1024 && TB_DKDV_SMEM <= 227 * 1024, "fits one SM's shared memory");

// S-shape, TF32: acc (64 x 64) = a (64 rows x 64 dims) b (64 rows x 64 dims)^T, both tiles as two
// 128-byte-wide halves of 64 rows (8 KB apart): 8 k-steps of 8 dims
__device__ __forceinline__ void issue_s_tf32(float (&acc)[32], const unsigned char* a, const unsigned char* b) {
#pragma unroll
    for (int ks = 0; ks < HS / 8; ks++)
        wgmma_tf32_n64(acc, desc_k(a + (ks >> 2) * TB_HALF + 32 * (ks & 3)), desc_k(b + (ks >> 2) * TB_HALF + 32 * (ks & 3)),
                       ks > 0);
}

// an S-shape accumulator (64 x 64 positions) as the tf32 A fragments of an O-shape (see the forward)
__device__ __forceinline__ void pack_a_tf32(uint32_t (&a)[8][4], const float (&x)[32]) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        a[j][0] = to_tf32(x[4 * j]);
        a[j][1] = to_tf32(x[4 * j + 2]);
        a[j][2] = to_tf32(x[4 * j + 1]);
        a[j][3] = to_tf32(x[4 * j + 3]);
    }
}

// O-shape, TF32: acc (64 x 64 dims) += A (64 x 64 positions, registers) B, B = a transposed tile (64 dims
// x 64 positions in vt_pos order) as two boxes of 32 positions (8 KB apart)
__device__ __forceinline__ void issue_o_tf32(float (&acc)[32], const uint32_t (&a)[8][4], const unsigned char* bt) {
#pragma unroll
    for (int j = 0; j < 8; j++) wgmma_tf32_rs_n64(acc, a[j], desc_k(bt + (j >> 2) * TB_HALF + 32 * (j & 3)), 1);
}

// (the colsum form) this warp's 16 rows' column sums of x as stored (x * sx, register 4j + 2hh + c: row
// r16 + g + 8hh, column 8j + 2t + c of the head; rows past T not stored, not summed): the two rows, then
// the 8 lanes g of each t (xor 4, 8, 16: a fixed order); lanes 0-3 write their 16 columns into prow,
// this warp's row of partials at the head's first column. Products and adds rounded as the stores are.
__device__ __forceinline__ void colsum_rows16_tf32(float* prow, const float (&x)[32], float sx, bool ok0, bool ok1,
                                                   int lane) {
    float s[16];
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int c = 0; c < 2; c++)
            s[2 * j + c] = __fadd_rn(ok0 ? __fmul_rn(x[4 * j + c], sx) : 0.0f, ok1 ? __fmul_rn(x[4 * j + 2 + c], sx) : 0.0f);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1)
#pragma unroll
        for (int e = 0; e < 16; e++) s[e] = __fadd_rn(s[e], __shfl_xor_sync(0xffffffffu, s[e], o));
    if (lane < 4) {
#pragma unroll
        for (int j = 0; j < 8; j++) *reinterpret_cast<float2*>(prow + 8 * j + 2 * lane) = make_float2(s[2 * j], s[2 * j + 1]);
    }
}

// maps: [0] qkvr (64 dims, T, 3 B NH) box (32, 64, 1); [1] dout (64 dims, NH, T, B) box (32, 1, 64, 1);
// [2] kt (Tp, 64, B NH) box (32, 64, 1) (not with SMT)
template <bool BTC, bool SMT>
__device__ __forceinline__ void flash_backward_dq_wgmma_tf32(float* dinp, float* Dbuf, const float* dout, const float* out,
                                                             const CUtensorMap* maps, const float* lse, int B, int NH,
                                                             int T, float scale, float* part) {
    extern __shared__ unsigned char smem_bwd[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_bwd) + 1023) & ~uintptr_t(1023));
    unsigned char* sq = smem;                // consumer cw's 64 rows: sq + cw * TB_TILE (two halves)
    unsigned char* sdo = smem + TB_RES;      // the same for dout
    unsigned char* skv = smem + 2 * TB_RES;  // stage s: k, v, kt tiles, TB_TILE apart
    uint64_t* qd_full = reinterpret_cast<uint64_t*>(skv + BWD_STAGES * TB_DQ_STAGE);
    uint64_t* full = qd_full + 1;
    uint64_t* empty = full + BWD_STAGES;
    uint64_t* tfull = empty + BWD_STAGES;  // SMT: the TMA's part of a stage has landed
    const CUtensorMap* tqkv = maps;
    const CUtensorMap* tdo = maps + 1;
    const CUtensorMap* tkt = maps + 2;

    const int C = NH * HS;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int qb = gridDim.y - 1 - blockIdx.y;  // the query blocks with the most key tiles first
    const int q0 = qb * BQ;
    const int nkt = 2 * qb + 2;                 // key tiles of 64: 0 .. 2 qb + 1; the last two hold the diagonal

    if (threadIdx.x == 0) {
        for (int s = 0; s < BWD_STAGES; s++) mbar_init(&tfull[s], 1);
        mbar_init_pipeline(qd_full, full, empty, BWD_STAGES, CONSUMER_WARPS, SMT ? 3 : 1);
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(SMT ? TF_SMT_PRODUCER_REGS : 24) : "memory");
        if (SMT && threadIdx.x >= 32) {  // warps 1-3: kt of each stage from its k tile
            for (int i = 0; i < nkt; i++) {
                const int s = i % BWD_STAGES;
                mbar_wait(&tfull[s], (i / BWD_STAGES) & 1);
                unsigned char* st = skv + s * TB_DQ_STAGE;
                transpose_tiles_tf32<TB_ROWS, 1>(st + 2 * TB_TILE, st, threadIdx.x - 32);
                transposed(&full[s]);
            }
        }
        if (threadIdx.x == 0) {
            tensormap_acquire(tqkv);
            tensormap_acquire(tdo);
            if (!SMT) tensormap_acquire(tkt);
            mbar_expect_tx(qd_full, 2 * TB_RES);
#pragma unroll
            for (int cw = 0; cw < 2; cw++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    tma_load_part<BTC>(sq + cw * TB_TILE + hf * TB_HALF, tqkv, qd_full, 32 * hf, q0 + 64 * cw, 0, b, h, B, NH);
                    tma_load_4d(sdo + cw * TB_TILE + hf * TB_HALF, tdo, qd_full, 32 * hf, h, q0 + 64 * cw, b);
                }
            for (int i = 0; i < nkt; i++) {
                const int s = i % BWD_STAGES, use = i / BWD_STAGES;
                mbar_wait(&empty[s], (use & 1) ^ 1);
                uint64_t* bar = SMT ? &tfull[s] : &full[s];
                mbar_expect_tx(bar, SMT ? 2 * TB_TILE : TB_DQ_STAGE);
                unsigned char* st = skv + s * TB_DQ_STAGE;
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    tma_load_part<BTC>(st + hf * TB_HALF, tqkv, bar, 32 * hf, i * TB_ROWS, 1, b, h, B, NH);            // k
                    tma_load_part<BTC>(st + TB_TILE + hf * TB_HALF, tqkv, bar, 32 * hf, i * TB_ROWS, 2, b, h, B, NH);  // v
                    if (!SMT) tma_load_3d(st + 2 * TB_TILE + hf * TB_HALF, tkt, bar, i * TB_ROWS + 32 * hf, 0, bh);  // kt
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(SMT ? TF_SMT_CONSUMER_REGS : 240) : "memory");

    const int cw = wg - 1;  // consumer: query rows 64 cw .. 64 cw + 63 of the block
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int row0 = q0 + 64 * cw + 16 * warp + g;  // this thread's rows: row0 (h = 0), row0 + 8 (h = 1)
    const float c2 = scale * LOG2E;
    const unsigned char* sqw = sq + cw * TB_TILE;
    const unsigned char* sdow = sdo + cw * TB_TILE;

    // D and lse (log2 units) of this thread's two rows, while the TMA brings q and dout: the 4 lanes of
    // a quad share a row, lane t sums dims 16t..16t+15, then the quad adds up
    float Dr[2], lr[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = row0 + 8 * hh;
        float d = 0.0f;
        if (row < T) {
            const size_t off = ((size_t)b * T + row) * C + h * HS + 16 * t;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const float4 x = *reinterpret_cast<const float4*>(dout + off + 4 * u);
                const float4 y = *reinterpret_cast<const float4*>(out + off + 4 * u);
                d = fmaf(x.x, y.x, d);
                d = fmaf(x.y, y.y, d);
                d = fmaf(x.z, y.z, d);
                d = fmaf(x.w, y.w, d);
            }
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        Dr[hh] = d;
        lr[hh] = row < T ? lse[(size_t)bh * T + row] * LOG2E : 0.0f;
        if (row < T && t == 0) Dbuf[(size_t)bh * T + row] = d;
    }

    float dq[32];
#pragma unroll
    for (int i = 0; i < 32; i++) dq[i] = 0.0f;
    float sc[32], dp[32];
    uint32_t da[8][4];
    mbar_wait(qd_full, 0);
    for (int i = 0; i < nkt; i++) {
        const unsigned char* st = skv + (i % BWD_STAGES) * TB_DQ_STAGE;
        mbar_wait(&full[i % BWD_STAGES], (i / BWD_STAGES) & 1);
        wgmma_fence();
        issue_s_tf32(sc, sqw, st);             // S = q k^T
        issue_s_tf32(dp, sdow, st + TB_TILE);  // dP = dout v^T
        wgmma_commit();
        wgmma_wait<0>();
        keep_in_regs(sc);
        keep_in_regs(dp);
        // dS = P (dP - D), P = 2^(c2 S - lse log2e); on the last two tiles keys > row are masked (keys
        // >= T too: > every row < T). Register 4j + e: row row0 + 8 (e >> 1), key 64 i + 8j + 2t + (e & 1)
        if (i >= nkt - 2) mask_scores<8>(sc, row0 - i * TB_ROWS - 2 * t);
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int hh = e >> 1;
                const float p = ex2(fmaf(sc[4 * j + e], c2, -lr[hh]));  // masked: 2^-inf = +0
                sc[4 * j + e] = p * (dp[4 * j + e] - Dr[hh]);
            }
        pack_a_tf32(da, sc);
        wgmma_fence();
        issue_o_tf32(dq, da, st + 2 * TB_TILE);  // dq += dS k (kt's tile)
        wgmma_commit();
        wgmma_wait<0>();
        keep_in_regs(dq);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[i % BWD_STAGES]);
    }

    // dq * scale -> dinp[..., 0:C] (register 4j + 2h + c at row row0 + 8h, dim 8j + 2t + c)
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = row0 + 8 * hh;
        if (row >= T) continue;
        float* dst = dinp + ((size_t)b * T + row) * 3 * C + h * HS + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; j++)
            *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(dq[4 * j + 2 * hh] * scale, dq[4 * j + 2 * hh + 1] * scale);
    }
    // (colsum form) the q columns of this warp's row of partials: 8 rows of 16 per query block of 128
    if (part != nullptr)
        colsum_rows16_tf32(part + ((size_t)b * gridDim.y * 8 + (row0 - g) / 16) * 3 * C + h * HS, dq, scale, row0 < T,
                           row0 + 8 < T, lane);
}

// flash_attention_backward_dq_kernel4_tf32<SFX>: flash_backward_dq_wgmma_tf32<BTC, SMT> (BWD4_DQ_ENTRY)
#define BWD4_DQ_TF32(SFX, ...)                                                                          \
    BWD4_DQ_ENTRY(flash_attention_backward_dq_kernel4_tf32##SFX, float, flash_backward_dq_wgmma_tf32, __VA_ARGS__)
// _btc: q, k, v from the forward's inp in place (maps[0]: 4D (64 dims, 3 NH, T, B), box (32, 1, 64, 1))
TF32_LAYOUTS(BWD4_DQ_TF32)

// maps: [0] qkvr, [1] dout (as the dq kernel), [2] qt, [3] dot (Tp, 64, B NH) box (32, 64, 1) (not with SMT)
template <bool BTC, bool SMT>
__device__ __forceinline__ void flash_backward_dkdv_wgmma_tf32(float* dinp, const CUtensorMap* maps, const float* lse,
                                                               const float* Dbuf, int B, int NH, int T, float scale,
                                                               float* part) {
    extern __shared__ unsigned char smem_bwd[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_bwd) + 1023) & ~uintptr_t(1023));
    unsigned char* sk = smem;                  // consumer cw's 64 keys: sk + cw * TB_TILE (two halves)
    unsigned char* sv = smem + TB_RES;
    unsigned char* sqd = smem + 2 * TB_RES;    // stage s: q, dout, qt, dot tiles, TB_TILE apart
    float* rows = reinterpret_cast<float*>(sqd + BWD_STAGES * TB_DKDV_STAGE);  // [consumer][buffer][lse | D] x 64
    uint64_t* kv_full = reinterpret_cast<uint64_t*>(rows + 2 * 2 * 2 * TB_ROWS);
    uint64_t* full = kv_full + 1;
    uint64_t* empty = full + BWD_STAGES;
    uint64_t* tfull = empty + BWD_STAGES;  // SMT: the TMA's part of a stage has landed
    const CUtensorMap* tqkv = maps;
    const CUtensorMap* tdo = maps + 1;
    const CUtensorMap* tqt = maps + 2;
    const CUtensorMap* tdot = maps + 3;

    const int C = NH * HS;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int kb = blockIdx.y;                  // key block 0 has the most query tiles: it starts first
    const int k0 = kb * BKV;
    const int nq = (T + TB_ROWS - 1) / TB_ROWS; // query tiles of 64 in a head
    const int it0 = 2 * kb, nt = nq - it0;      // query tiles it0 .. nq - 1 (the first two hold the diagonal)

    if (threadIdx.x == 0) {
        for (int s = 0; s < BWD_STAGES; s++) mbar_init(&tfull[s], 1);
        mbar_init_pipeline(kv_full, full, empty, BWD_STAGES, CONSUMER_WARPS, SMT ? 3 : 1);
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(SMT ? TF_SMT_PRODUCER_REGS : 24) : "memory");
        if (SMT && threadIdx.x >= 32) {  // warps 1-3: qt and dot of each stage from its q and dout tiles
            for (int i = 0; i < nt; i++) {
                const int s = i % BWD_STAGES;
                mbar_wait(&tfull[s], (i / BWD_STAGES) & 1);
                unsigned char* st = sqd + s * TB_DKDV_STAGE;
                transpose_tiles_tf32<TB_ROWS, 2>(st + 2 * TB_TILE, st, threadIdx.x - 32);  // qt from q, dot from dout
                transposed(&full[s]);
            }
        }
        if (threadIdx.x == 0) {
            tensormap_acquire(tqkv);
            tensormap_acquire(tdo);
            if (!SMT) {
                tensormap_acquire(tqt);
                tensormap_acquire(tdot);
            }
            mbar_expect_tx(kv_full, 2 * TB_RES);
#pragma unroll
            for (int cw = 0; cw < 2; cw++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    tma_load_part<BTC>(sk + cw * TB_TILE + hf * TB_HALF, tqkv, kv_full, 32 * hf, k0 + 64 * cw, 1, b, h, B, NH);
                    tma_load_part<BTC>(sv + cw * TB_TILE + hf * TB_HALF, tqkv, kv_full, 32 * hf, k0 + 64 * cw, 2, b, h, B, NH);
                }
            for (int i = 0; i < nt; i++) {
                const int s = i % BWD_STAGES, use = i / BWD_STAGES, r0 = (it0 + i) * TB_ROWS;
                mbar_wait(&empty[s], (use & 1) ^ 1);
                uint64_t* bar = SMT ? &tfull[s] : &full[s];
                mbar_expect_tx(bar, SMT ? 2 * TB_TILE : TB_DKDV_STAGE);
                unsigned char* st = sqd + s * TB_DKDV_STAGE;
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    tma_load_part<BTC>(st + hf * TB_HALF, tqkv, bar, 32 * hf, r0, 0, b, h, B, NH);    // q
                    tma_load_4d(st + TB_TILE + hf * TB_HALF, tdo, bar, 32 * hf, h, r0, b);           // dout
                    if (!SMT) {
                        tma_load_3d(st + 2 * TB_TILE + hf * TB_HALF, tqt, bar, r0 + 32 * hf, 0, bh);  // qt
                        tma_load_3d(st + 3 * TB_TILE + hf * TB_HALF, tdot, bar, r0 + 32 * hf, 0, bh); // dot
                    }
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(SMT ? TF_SMT_CONSUMER_REGS : 240) : "memory");

    const int cw = wg - 1;  // consumer: keys 64 cw .. 64 cw + 63 of the block
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int key0 = k0 + 64 * cw + 16 * warp + g;  // this thread's keys: key0 (h = 0), key0 + 8 (h = 1)
    const float c2 = scale * LOG2E;
    const unsigned char* skw = sk + cw * TB_TILE;
    const unsigned char* svw = sv + cw * TB_TILE;
    float* myrows = rows + cw * 2 * 2 * TB_ROWS;  // this warpgroup's two buffers of a tile's lse, D
    const float* lseh = lse + (size_t)bh * T;
    const float* Dh = Dbuf + (size_t)bh * T;

    // threads 0..63: one query of the tile each, its lse and D, 0 past T; a tile ahead. lse is taken
    // to log2 units only where it is staged (a multiply at the load would wait for it right there)
    auto load_rows = [&](int i, float& l, float& d) {
        const int qpos = (it0 + i) * TB_ROWS + tid;
        l = tid < TB_ROWS && qpos < T ? lseh[qpos] : 0.0f;
        d = tid < TB_ROWS && qpos < T ? Dh[qpos] : 0.0f;
    };
    float l_next, d_next;
    load_rows(0, l_next, d_next);

    float dk[32], dv[32];
#pragma unroll
    for (int i = 0; i < 32; i++) dk[i] = dv[i] = 0.0f;
    float sc[32], dp[32];
    uint32_t pa[8][4], da[8][4];
    mbar_wait(kv_full, 0);
    for (int i = 0; i < nt; i++) {
        // this tile's lse, D into buffer i & 1 (its last readers, tile i - 2, are past tile i - 1's barrier)
        float* r = myrows + (i & 1) * 2 * TB_ROWS;
        if (tid < TB_ROWS) {
            r[tid] = l_next * LOG2E;
            r[TB_ROWS + tid] = d_next;
        }
        if (i + 1 < nt) load_rows(i + 1, l_next, d_next);
        wg_barrier(1 + cw);

        const unsigned char* st = sqd + (i % BWD_STAGES) * TB_DKDV_STAGE;
        mbar_wait(&full[i % BWD_STAGES], (i / BWD_STAGES) & 1);
        wgmma_fence();
        issue_s_tf32(sc, skw, st);            // S^T = k q^T
        issue_s_tf32(dp, svw, st + TB_TILE);  // dP^T = v dout^T
        wgmma_commit();
        wgmma_wait<0>();
        keep_in_regs(sc);
        keep_in_regs(dp);
        // P^T per column (query), dS^T = P^T (dP^T - D). Masked: queries < key (the first two tiles) and
        // queries >= T (zero-filled). Register 4j + e: key key0 + 8 (e >> 1), query q0 + 8j + 2t + (e & 1)
        const int q0 = (it0 + i) * TB_ROWS;
        if (i < 2 || i == nt - 1) mask_scores_t<8>(sc, q0 + 2 * t - key0, T - q0 - 2 * t);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float2 lq = *reinterpret_cast<const float2*>(r + 8 * j + 2 * t);
            const float2 dd = *reinterpret_cast<const float2*>(r + TB_ROWS + 8 * j + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = e & 1;
                const float p = ex2(fmaf(sc[4 * j + e], c2, -(c ? lq.y : lq.x)));  // masked: 2^-inf = +0
                sc[4 * j + e] = p;
                dp[4 * j + e] = p * (dp[4 * j + e] - (c ? dd.y : dd.x));
            }
        }
        pack_a_tf32(pa, sc);
        pack_a_tf32(da, dp);
        wgmma_fence();
        issue_o_tf32(dv, pa, st + 3 * TB_TILE);  // dv += P^T dout (dot's tile)
        issue_o_tf32(dk, da, st + 2 * TB_TILE);  // dk += dS^T q (qt's tile)
        wgmma_commit();
        wgmma_wait<0>();
        keep_in_regs(dv);
        keep_in_regs(dk);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[i % BWD_STAGES]);
    }

    // dk * scale -> dinp[..., C:2C], dv -> dinp[..., 2C:3C]
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int key = key0 + 8 * hh;
        if (key >= T) continue;
        float* dst = dinp + ((size_t)b * T + key) * 3 * C + h * HS + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            *reinterpret_cast<float2*>(dst + C + 8 * j) = make_float2(dk[4 * j + 2 * hh] * scale, dk[4 * j + 2 * hh + 1] * scale);
            *reinterpret_cast<float2*>(dst + 2 * C + 8 * j) = make_float2(dv[4 * j + 2 * hh], dv[4 * j + 2 * hh + 1]);
        }
    }
    // (colsum form) the k and v columns of this warp's row of partials (the dq kernel's rows: keys are rows)
    if (part != nullptr) {
        float* prow = part + ((size_t)b * gridDim.y * 8 + (key0 - g) / 16) * 3 * C + h * HS;
        colsum_rows16_tf32(prow + C, dk, scale, key0 < T, key0 + 8 < T, lane);
        colsum_rows16_tf32(prow + 2 * C, dv, 1.0f, key0 < T, key0 + 8 < T, lane);
    }
}

// flash_attention_backward_dkdv_kernel4_tf32<SFX>: flash_backward_dkdv_wgmma_tf32<BTC, SMT> (BWD4_DKDV_ENTRY)
#define BWD4_DKDV_TF32(SFX, ...)                                                                        \
    BWD4_DKDV_ENTRY(flash_attention_backward_dkdv_kernel4_tf32##SFX, float, flash_backward_dkdv_wgmma_tf32, __VA_ARGS__)
TF32_LAYOUTS(BWD4_DKDV_TF32)
