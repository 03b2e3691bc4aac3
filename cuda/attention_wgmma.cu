// Fused causal attention on Hopper tensor cores: wgmma + TMA, bf16 (sm_90a only).
//
//   flash_attention_forward_kernel4_bf16   attention_forward variant 4 (bf16 build only):
//       out (B,T,C) = softmax(scale q k^T, causal) v, rounded to bf16 once;
//       lse (B,NH,T) = log sum_{s<=t} exp(scale q_t.k_s), fp32 (what the fused backward 2/3 reads)
//
// Build: nvcc -gencode=arch=compute_90a,code=sm_90a (llmc/runtime.py: ARCH_SPECIFIC).
// Lab:   python dev/cuda/attention_forward.py 4 --dtype bf16
// Tests: python -m pytest -m gpu tests/test_attention.py -k wgmma
//
// Why: variants 2/3 issue mma.sync m16n8k16, which on Hopper tops out near 60% of the tensor cores'
// rate (~100-110 TFLOP/s here). This is the FlashAttention-3 recipe written for this project: the
// products are warpgroup-wide wgmma, the k/v tiles come in by the TMA on an mbarrier pipeline fed by
// a producer warpgroup, and p goes from the fp32 score registers straight into the second product.
//
// One CTA per (b, h, block of 128 query rows), 3 warpgroups:
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
// The two consumer warpgroups share the tensor cores: while one does its softmax the other's
// products run (no explicit ping-pong barriers between them yet). The _overlap entry point also
// overlaps inside a warpgroup: tile i+1's q k^T is issued before tile i's p v, and tile i+1's softmax
// runs while p v is on the tensor cores (the same bits; the lab times both, the faster one should
// become the variant's only kernel).
//
// Layouts (g = lane/4, t = lane%4, w = warp within the warpgroup):
// * Global: q, k, v come from qkvr (3, B, NH, T, 64), written by the bf16 permute just before. The TMA
//   sees it as a 3D tensor (64 dims, T rows, 3*B*NH slabs): q of head bh is slab bh, k slab BNH+bh, v
//   slab 2*BNH+bh. Boxes are (64, 128, 1); rows past T of a slab are zero-filled by the TMA (T not a
//   multiple of 128, T = 1 included), never the next head's rows.
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
constexpr int STAGES = 2;                   // k/v ring depth
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
// PTX helpers: cuda/hopper.cuh has the shared ones; the 3D TMA load is this kernel's


// 3D box at coordinates (c0 = dim, c1 = row, c2 = slab), completing on `bar`
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
                 ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}



// Descriptor of a K-major 128-byte-swizzled tile (q, k): start address, LBO 16 (unused), SBO 1024
// (next 8 rows), layout type 1 (SW128) in bits 62-63.
__device__ __forceinline__ uint64_t desc_k(const void* p) {
    const uint64_t addr = smem_u32(p);
    return ((addr & 0x3FFFF) >> 4) | (uint64_t(16 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Descriptor of the N-major v tile (keys x 64 dims, 128-byte swizzled by key row): SBO 1024 (next 8
// keys), LBO = the next 64-wide block of n (there is none at N = 64; set to the tile size), SW128.
__device__ __forceinline__ uint64_t desc_mn(const void* p) {
    const uint64_t addr = smem_u32(p);
    return ((addr & 0x3FFFF) >> 4) | (uint64_t(KV_BYTES >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ float ex2(float x) {  // 2^x; ex2.approx(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {  // lo in the low half (lower column)
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

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

// Online softmax of one tile of scores, in place: sc <- p = 2^(scale log2e s - m) in fp32, the running
// max m (log2 units) and sum l updated, corr = the factor O must be rescaled by. Only the diagonal
// tile (the last) has keys > some row of the block; it also holds every key >= T (zero-filled),
// and those are > every row < T: masked too. key0: the tile's first key; row0: this thread's first row.
__device__ __forceinline__ void softmax_tile(float (&sc)[64], float (&m)[2], float (&l)[2], float (&corr)[2],
                                             bool diag, int key0, int row0, int t, float c2) {
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < 16; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int hh = e >> 1;
            float x = sc[4 * j + e] * c2;
            if (diag && key0 + 8 * j + 2 * t + (e & 1) > row0 + 8 * hh) x = -INFINITY;
            sc[4 * j + e] = x;
            mx[hh] = fmaxf(mx[hh], x);
        }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {  // the 4 lanes of a quad hold a row's 128 columns
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
        // 0 on the first tile (m = -inf; key 0 is never masked), exactly 1 when the max holds
        corr[hh] = mx[hh] == m[hh] ? 1.0f : ex2(m[hh] - mx[hh]);
        m[hh] = mx[hh];
        l[hh] *= corr[hh];
    }
    // p in fp32; l sums the fp32 p (lse stays fp32-accurate; p v uses p rounded to bf16)
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int hh = r & 1;
            const float p0 = ex2(sc[8 * kk + 2 * r] - m[hh]), p1 = ex2(sc[8 * kk + 2 * r + 1] - m[hh]);
            sc[8 * kk + 2 * r] = p0;
            sc[8 * kk + 2 * r + 1] = p1;
            l[hh] += p0 + p1;
        }
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

// tm: the 3D tensor map of qkvr (see Layouts), in global memory. OVERLAP: the scores of the next tile
// are issued before p v of this one (FlashAttention-3's intra-warpgroup overlap; see the loop).
template <bool OVERLAP>
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

    const int BNH = B * NH, C = NH * HS;
    const int bh = blockIdx.x;
    const int qb = gridDim.y - 1 - blockIdx.y;  // the query blocks with the most key tiles first
    const int q0 = qb * BQ;
    const int nkt = qb + 1;                     // key tiles 0..qb; tile qb holds the diagonal

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);                  // the producer's expect_tx arrival (+ the bytes)
            mbar_init(&empty[s], CONSUMER_WARPS);    // lane 0 of every consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (threadIdx.x == 0) {
            tensormap_acquire(tm);
            mbar_expect_tx(q_full, Q_BYTES);
            tma_load_3d(sq, tm, q_full, 0, q0, bh);
            for (int i = 0; i < nkt; i++) {
                const int s = i % STAGES, use = i / STAGES;
                mbar_wait(&empty[s], (use & 1) ^ 1);
                mbar_expect_tx(&full[s], STAGE_BYTES);
                unsigned char* sk = skv + s * STAGE_BYTES;
                tma_load_3d(sk, tm, &full[s], 0, i * BKV, BNH + bh);                // k
                tma_load_3d(sk + KV_BYTES, tm, &full[s], 0, i * BKV, 2 * BNH + bh);  // v
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

    const int cw = wg - 1;  // consumer: query rows 64 cw .. 64 cw + 63 of the block
    const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int row0 = q0 + 64 * cw + 16 * warp + g;  // this thread's rows: row0 (h = 0), row0 + 8 (h = 1)
    const float c2 = scale * LOG2E;                 // scores -> log2 units
    const unsigned char* sqw = sq + cw * 64 * ROW_BYTES;

    float o[32];
#pragma unroll
    for (int i = 0; i < 32; i++) o[i] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (log2 units), partial sum

    mbar_wait(q_full, 0);
    auto stage_k = [&](int i) { return skv + (i % STAGES) * STAGE_BYTES; };
    auto stage_v = [&](int i) { return skv + (i % STAGES) * STAGE_BYTES + KV_BYTES; };
    auto wait_full = [&](int i) { mbar_wait(&full[i % STAGES], (i / STAGES) & 1); };
    // both products have read tile i's stage: release it to the producer (one arrival per warp)
    auto release = [&](int i) { __syncwarp(); if (lane == 0) mbar_arrive(&empty[i % STAGES]); };
    float sc[64];
    uint32_t pa[8][4];
    float corr[2];
    if constexpr (!OVERLAP) {
        for (int i = 0; i < nkt; i++) {
            wait_full(i);
            wgmma_fence();
            issue_s(sc, sqw, stage_k(i));
            wgmma_commit();
            wgmma_wait<0>();
            keep_in_regs(sc);
            softmax_tile(sc, m, l, corr, i == nkt - 1, i * BKV, row0, t, c2);
            rescale_o(o, corr);
            pack_p(pa, sc);
            wgmma_fence();
            issue_pv(o, pa, stage_v(i));
            wgmma_commit();
            wgmma_wait<0>();  // also: the P registers may be reused only after this
            keep_in_regs(o);
            release(i);
        }
    } else {
        // The scores of tile i + 1 are issued before p v of tile i, so the softmax of tile i + 1 runs
        // on the CUDA cores while the tensor cores do p v of tile i (wait_group 1: the older group,
        // S, is done; p v may still run). O is rescaled by tile i + 1's correction only once p v of
        // tile i has landed, and P i + 1 is packed only then (P i's registers are p v's operand).
        // Per row the same operations in the same order as !OVERLAP: the same bits.
        wait_full(0);
        wgmma_fence();
        issue_s(sc, sqw, stage_k(0));
        wgmma_commit();
        wgmma_wait<0>();
        keep_in_regs(sc);
        softmax_tile(sc, m, l, corr, nkt == 1, 0, row0, t, c2);
        rescale_o(o, corr);
        pack_p(pa, sc);
        for (int i = 0; i + 1 < nkt; i++) {
            wait_full(i + 1);
            wgmma_fence();
            issue_s(sc, sqw, stage_k(i + 1));
            wgmma_commit();
            issue_pv(o, pa, stage_v(i));
            wgmma_commit();
            wgmma_wait<1>();
            keep_in_regs(sc);
            softmax_tile(sc, m, l, corr, i + 1 == nkt - 1, (i + 1) * BKV, row0, t, c2);
            wgmma_wait<0>();
            keep_in_regs(o);
            release(i);
            rescale_o(o, corr);
            pack_p(pa, sc);
        }
        wgmma_fence();  // the last tile's p v
        issue_pv(o, pa, stage_v(nkt - 1));
        wgmma_commit();
        wgmma_wait<0>();
        keep_in_regs(o);
        release(nkt - 1);
    }

    // out = O / l (bf16, one rounding), lse = (m + log2 l) ln 2
    const int b = bh / NH, h = bh % NH;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = row0 + 8 * hh;
        float lr = l[hh];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        if (row >= T) continue;
        const float inv = 1.0f / lr;
        bf16* dst = out + ((size_t)b * T + row) * C + h * HS + 2 * t;
#pragma unroll
        for (int j = 0; j < 8; j++)
            *reinterpret_cast<uint32_t*>(dst + 8 * j) = pack_bf16(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
        if (t == 0) lse[(size_t)bh * T + row] = (m[hh] + __log2f(lr)) * LN2;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_attention_forward_kernel4_bf16(bf16* out, float* lse, const CUtensorMap* tm, int B, int NH, int T, float scale) {
    flash_forward_wgmma<false>(out, lse, tm, B, NH, T, scale);
}
// the lab's overlap=True build (llmc/ops/attention.py); the same bits as the plain one
extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_attention_forward_kernel4_bf16_overlap(bf16* out, float* lse, const CUtensorMap* tm, int B, int NH, int T,
                                             float scale) {
    flash_forward_wgmma<true>(out, lse, tm, B, NH, T, scale);
}
