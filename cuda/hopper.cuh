// Hopper (sm_90a) helpers shared by cuda/gemm_wgmma.cu and cuda/attention_wgmma.cu: shared-memory
// addresses, mbarriers, the tensor-map fence, wgmma group bookkeeping.
#pragma once
#include <cuda.h>
#include <stdint.h>
#include "common.cuh"  // LLMC_PDL_WAIT

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// A TMA pipeline's barriers, set up by one thread before a __syncthreads: `once` (one arrival: the
// producer's expect_tx for what is loaded once per CTA), then per stage `full` (one arrival: the
// producer's expect_tx, plus the bytes) and `empty` (`consumers` arrivals: lane 0 of every consumer
// warp), and the fence that makes the initialised barriers visible to the TMA unit.
// (full_arrivals: more arrivals on `full` besides the producer's, for stages that other threads
// complete after the TMA, e.g. the TF32 attention backward's shared-memory transposes)
__device__ __forceinline__ void mbar_init_pipeline(uint64_t* once, uint64_t* full, uint64_t* empty, int stages,
                                                   unsigned consumers, unsigned full_arrivals = 1) {
    mbar_init(once, 1);
    for (int s = 0; s < stages; s++) {
        mbar_init(&full[s], full_arrivals);
        mbar_init(&empty[s], consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// the producer's arrival: one arrive, and the barrier also waits for `bytes` of TMA traffic
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// wait until the phase with this parity has completed (a fresh barrier counts phase "-1", parity 1,
// as completed: that is how the producer's first pass over the empty stages goes straight through).
// LLMC_MBAR_SUSPEND (a -D define, nanoseconds; 0, the default: none): the try_wait's suspend-time hint,
// how long the hardware may hold the waiting thread before try_wait returns false; without one it
// returns after a time of the hardware's choosing and the loop issues again (session 43's ncu: engine 5
// issues ~1.8x cuBLAS's instructions at d12's shapes, its ALU pipe 13-23% busy against 2-4%). Session 44,
// H200, 10000000 on gemm_wgmma and attention_wgmma: whole bf16 steps level (-0.3% / +0.2% at B=16 in two calls).
#ifndef LLMC_MBAR_SUSPEND
#define LLMC_MBAR_SUSPEND 0
#endif
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
    const uint32_t addr = smem_u32(bar);
    uint32_t done;
    do {
#if LLMC_MBAR_SUSPEND > 0
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(addr), "r"(parity), "r"((unsigned)LLMC_MBAR_SUSPEND) : "memory");
#else
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(addr), "r"(parity) : "memory");
#endif
    } while (!done);
}

// The tensor maps live in global memory (written by the host before the launch), not in kernel
// parameters: a 64-byte-aligned __grid_constant__ parameter arrived misplaced through PyCUDA's packed
// argument buffer (seen on the H100: every parameter after it read garbage). This fence makes the
// tensor-map proxy see what the generic proxy (the host's copy) wrote there.
__device__ __forceinline__ void tensormap_acquire(const CUtensorMap* map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// the accumulators are written by the async wgmma: stop the compiler moving reads above the wait
template <int NREG>
__device__ __forceinline__ void keep_in_regs(float (&d)[NREG]) {
#pragma unroll
    for (int i = 0; i < NREG; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a wgmma operand tile laid out with the 128-byte swizzle (what
// the TMA's CU_TENSOR_MAP_SWIZZLE_128B writes: rows of 128 bytes, 16-byte chunk c of row r stored at
// chunk c ^ (r % 8), 1024-byte atoms of 8 rows): start address >> 4 in bits 0-13, leading byte offset
// >> 4 in bits 16-29, stride byte offset >> 4 in bits 32-45, layout type 1 (SW128) in bits 62-63.
//   K-major tile (k contiguous, 64 bf16 per row): lbo is unused by the swizzled layout (pass 16),
//     sbo = 1024 (the next 8 rows); a k16 step is +32 bytes on the start address.
//   MN-major tile (k rows of 64 mn elements, 128 bytes each): lbo = bytes to the next 64-wide block of
//     mn (when N or M > 64), sbo = 1024 (the next 8 k rows); a k16 step is +2048 bytes (two atoms).
// cuda/gemm_wgmma.cu: smem_desc(p) = wgmma_desc_sw128(p, 16), smem_desc_mn(p) =
// wgmma_desc_sw128(p, BK_T * ROW_BYTES).
// The two 32-bit halves: the low one (start address, lbo) and the high one (sbo, layout type), which
// engine 5's mainloops keep apart (cuda/gemm_wgmma.cu: a stage's descriptor is stepped by adding to the low half).
__device__ __forceinline__ uint32_t wgmma_desc_lo(const void* p, uint32_t lbo) {
    return ((smem_u32(p) & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16);
}
__host__ __device__ constexpr uint32_t wgmma_desc_hi(uint32_t sbo = 1024) { return ((sbo & 0x3FFFF) >> 4) | (1u << 30); }
__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* p, uint32_t lbo, uint32_t sbo = 1024) {
    return (uint64_t(wgmma_desc_hi(sbo)) << 32) | wgmma_desc_lo(p, lbo);
}
