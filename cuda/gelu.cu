// GELU, GPT-2's tanh approximation, elementwise over N floats:
//   gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))),  k = sqrt(2/pi)
//   gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) k (1 + 3*0.044715 x^2),  u = k (x + 0.044715 x^3)
//
// gelu_forward (--gelu-kernel N):
//   1  one thread per element (any N)
//   2  one thread per 4 elements, float4 loads/stores (N % 4 == 0)
// gelu_backward (--gelu-backward-kernel N): dinp = gelu'(inp) * dout (overwrites dinp)
//   1  one thread per element (any N)
//   2  one thread per 4 elements, float4 loads/stores (N % 4 == 0)
//   2 colsum: 2's fused form over (rows, OC), also colsum (OC) += column sums of dinp (fc's bias
//      gradient, instead of a matmul_backward_bias pass; see "colsum" at the end)
//
// gelu_backward may run in place (dinp == dout): each thread reads its own elements of dout before
// writing the same elements of dinp, and nothing else touches them; no __restrict__ on that pair.
// tanhf, not the fast tanh.approx: its ~1e-3 relative error would show against the fp64 reference.
// Memory traffic at N = B*T*4C = 4*1024*3072 (12.6M floats): forward reads + writes 100.7 MB
// (33.8 us at 2.98 TB/s); backward reads 2 and writes 1: 151 MB (50.7 us).
// Measured on the lent H100 (dev/cuda lab: median of 30, L2 flushed before each, best block size):
//   forward   1: 48.8 us (2.06 TB/s)   2: 37.7 us (2.67 TB/s)
//   backward  1: 63.6 us (2.37 TB/s)   2: 54.9 us (2.75 TB/s)
//
// bf16 builds (entry points <name>_bf16; inp, dout, out, dinp all bf16, math in fp32, one rounding
// on the store): variant 1 one thread per element, variant 2 one thread per 16 bytes (8 bf16) with a
// scalar tail, so any N. Half the bytes: forward 50.3 MB (16.9 us), backward 75.5 MB (25.3 us) at
// the same N. At 8 elements per 16 bytes, tanhf (~25 instructions) would put the forward near the
// ALU's limit (about 13 us of issue for 12.6M elements), so the bf16 builds use the same function
// written without tanh: 0.5 (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + exp(-2u)), with __expf and a fast
// divide, ~2^-21 relative error, far under bf16's 2^-9 rounding. The gradient in the same terms:
//   gelu'(x) = s + 2 x s (1 - s) k (1 + 3*0.044715 x^2),  s = sigmoid(2u)   (1 - tanh^2 = 4 s (1 - s))
#include "common.cuh"
#include "elem.cuh"

// gelu_fwd, gelu_fwd_sigmoid, gelu_grad, gelu_grad_sigmoid, GELU_K and GELU_C live in common.cuh (the
// decode GEMV applies gelu_fwd in its epilogue; GEMM engine 5's fused epilogues gelu_fwd_as<T> and
// gelu_bwd_as<T>, elem.cuh): one definition of each form, written so that its bits depend on x only

// ----------------------------------------------------------------------------------------------
// gelu_forward: out (N), inp (N)

extern "C" __global__ void gelu_forward_kernel1(float* out, const float* inp, int N) {
    LLMC_PDL_WAIT();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = gelu_fwd(inp[i]);
}

extern "C" __global__ void gelu_forward_kernel2(float* out, const float* inp, int N) {
    LLMC_PDL_WAIT();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N / 4) {
        float4 x = load4(inp + 4 * i);
        store4(out + 4 * i, make_float4(gelu_fwd(x.x), gelu_fwd(x.y), gelu_fwd(x.z), gelu_fwd(x.w)));
    }
}

// ----------------------------------------------------------------------------------------------
// gelu_backward: dinp (N) =, inp (N), dout (N); dinp may be dout

extern "C" __global__ void gelu_backward_kernel1(float* dinp, const float* inp, const float* dout, int N) {
    LLMC_PDL_WAIT();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) dinp[i] = gelu_bwd_as<float>(inp[i], dout[i]);
}

extern "C" __global__ void gelu_backward_kernel2(float* dinp, const float* inp, const float* dout, int N) {
    LLMC_PDL_WAIT();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N / 4) {
        float4 x = load4(inp + 4 * i), d = load4(dout + 4 * i);
        store4(dinp + 4 * i, make_float4(gelu_bwd_as<float>(x.x, d.x), gelu_bwd_as<float>(x.y, d.y),
                                         gelu_bwd_as<float>(x.z, d.z), gelu_bwd_as<float>(x.w, d.w)));
    }
}

// ----------------------------------------------------------------------------------------------
// bf16 builds. Templated on the element type T; only the bf16 instantiations have entry points
// (the fp32 kernels above keep their tanhf form and their measured numbers).

template <typename T>
__device__ __forceinline__ void gelu_forward1(T* out, const T* inp, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = from_f32<T>(gelu_fwd_as<T>(to_f32(inp[i])));
}

// one thread per 16 bytes: elements [V*i, V*i + V); the last thread takes the n < V left over
template <typename T>
__device__ __forceinline__ void gelu_forward2(T* out, const T* inp, int N) {
    constexpr int V = Vec16<T>::N;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const long e = (long)i * V;
    if (e >= N) return;
    const int n = min(V, (int)(N - e));
    float x[V];
    load_vec<T>(x, inp + e, n == V, n);
#pragma unroll
    for (int k = 0; k < V; k++) x[k] = gelu_fwd_as<T>(x[k]);
    store_vec<T>(out + e, x, n == V, n);
}

template <typename T>
__device__ __forceinline__ void gelu_backward1(T* dinp, const T* inp, const T* dout, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) dinp[i] = from_f32<T>(gelu_bwd_as<T>(to_f32(inp[i]), to_f32(dout[i])));
}

// dinp may be dout: this thread loads its 16 bytes of both before it stores those of dinp
template <typename T>
__device__ __forceinline__ void gelu_backward2(T* dinp, const T* inp, const T* dout, int N) {
    constexpr int V = Vec16<T>::N;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const long e = (long)i * V;
    if (e >= N) return;
    const int n = min(V, (int)(N - e));
    float x[V], d[V];
    load_vec<T>(x, inp + e, n == V, n);
    load_vec<T>(d, dout + e, n == V, n);
#pragma unroll
    for (int k = 0; k < V; k++) x[k] = gelu_bwd_as<T>(x[k], d[k]);
    store_vec<T>(dinp + e, x, n == V, n);
}

extern "C" __global__ void gelu_forward_kernel1_bf16(bf16* out, const bf16* inp, int N) {
    LLMC_PDL_WAIT();
    gelu_forward1<bf16>(out, inp, N);
}
extern "C" __global__ void gelu_forward_kernel2_bf16(bf16* out, const bf16* inp, int N) {
    LLMC_PDL_WAIT();
    gelu_forward2<bf16>(out, inp, N);
}
extern "C" __global__ void gelu_backward_kernel1_bf16(bf16* dinp, const bf16* inp, const bf16* dout, int N) {
    LLMC_PDL_WAIT();
    gelu_backward1<bf16>(dinp, inp, dout, N);
}
extern "C" __global__ void gelu_backward_kernel2_bf16(bf16* dinp, const bf16* inp, const bf16* dout, int N) {
    LLMC_PDL_WAIT();
    gelu_backward2<bf16>(dinp, inp, dout, N);
}

// ----------------------------------------------------------------------------------------------
// colsum: gelu_backward 2's fused form (gelu_backward with colsum=True; llmc/ops/gelu.py). In the
// model dinp is d fch (B*T, 4C), and the next thing read from it is fc's bias gradient, its column
// sums: matmul_backward_bias re-reads the whole (rows, OC) tensor this kernel has just written. Here
// the kernel sums it while it writes it:
//   dinp (rows, OC) = gelu'(inp) * dout, colsum (OC) += sum over rows of dinp (as stored: in bf16
//   the rounded values, what a bias kernel would read back)
// Layout (matmul_backward_bias 4's): block (32, 8) owns 32*V columns (lane tx: the V adjacent
// columns of one 16-byte vector) of one chunk of rows; row-lane ty takes rows ty, ty+8, ... of the
// chunk, GELU_CS_UNROLL (2) at a time, all their loads issued before the first store (dinp may be
// dout, so the compiler may not hoist a later row's loads above a store: the source order does it).
// Its V column sums stay in registers (fp32); the block adds its 8 row-lanes in order into one partial row
// (chunks, OC) fp32; the last block of each column block (an integer ticket, as bias 4) adds the
// chunks' partials in chunk order and does colsum "+=" (read, add in fp32, round once). Every sum
// has a fixed order: the same bits on every run, and graph replays (the counters are reset by the
// block that finishes). OC % V != 0: rows are not 16-byte aligned; guarded scalar accesses.
// Bytes over gelu_backward 2: the partials (chunks * OC floats, written then read from L2; ~1 MB at
// d12, B=16) and nothing over (rows, OC): the bias pass's N*OC read is gone.


// GELU_CS_UNROLL: rows a row-lane loads (both inputs) before its first store. 2 since session 34 (was
// 4; a lane adds its rows in row order either way). H200, lab (L2 flushed, medians), bf16 colsum /
// colsum + gelu (-r 1's form): B=4 0.0284 / 0.0344 ms against 4's
// 0.0303 / 0.0352 (91% / 92% of a copy, was 83% / 89%), B=16 0.0861 / 0.1131 against 0.0896 / 0.1156;
// 1 gave 0.0290 / 0.0345 at B=4, 8 twice the time. bf16 steps on text ids: B=4 8.39 against 8.46 ms,
// B=16 29.11 against 29.21. (fp32: colsum level or faster, colsum + gelu B=4 0.0595 against 0.0583.)
// A lab knob: --define gelu:GELU_CS_UNROLL=U (tests/test_gelu.py: other values give the same bits where
// the build takes the same chunks of rows; the chunks follow the blocks resident an SM, so the registers).
#ifndef GELU_CS_UNROLL
#define GELU_CS_UNROLL 2
#endif

// thread (tx, 0) ends with the sum of the 8 row-lanes' s, added in row-lane order (the same bits on
// every run); every thread of the block must call it
template <int V>
__device__ __forceinline__ void sum_row_lanes(float (&s)[V], float (*sh)[32][V + 1], int tx, int ty) {
#pragma unroll
    for (int k = 0; k < V; k++) sh[ty][tx][k] = s[k];
    __syncthreads();
    if (ty == 0) {
#pragma unroll
        for (int y = 1; y < 8; y++) {
#pragma unroll
            for (int k = 0; k < V; k++) s[k] += sh[y][tx][k];
        }
    }
}

// RC (the recompute form, gelu_backward with colsum and recompute=True): also gout = gelu(inp), by
// gelu_forward's function for T: the GELU that backward's recompute (-r >= 1) would launch
// gelu_forward for, here from the inp this kernel reads anyway (one read of fch instead of two)
template <typename T, bool RC = false>
__device__ __forceinline__ void gelu_backward_colsum_t(T* dinp, T* colsum, float* partial, unsigned int* counters,
        const T* inp, const T* dout, int rows, int OC, int rows_per_chunk, T* gout = nullptr) {
    constexpr int V = Vec16<T>::N;
    typedef typename Vec16<T>::raw raw;
    __shared__ float sh[8][32][V + 1];  // (+1: lanes V+1 floats apart, fewer bank conflicts)
    __shared__ bool is_last;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = V * (blockIdx.x * 32 + tx);
    const int ncol = min(V, OC - col);  // <= 0: this lane is past the row
    const bool vec = OC % V == 0;
    const int r0 = blockIdx.y * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
    float s[V];
#pragma unroll
    for (int k = 0; k < V; k++) s[k] = 0.0f;
    if (ncol > 0) {
        for (int n = r0 + ty; n < r1; n += 8 * GELU_CS_UNROLL) {
            // the group's rows held as raw 16-byte words (bf16: 4 registers for 8 values), unpacked on use
            raw xr[GELU_CS_UNROLL], dr[GELU_CS_UNROLL];
#pragma unroll
            for (int u = 0; u < GELU_CS_UNROLL; u++) {  // every load of the group before any store
                const int r = n + 8 * u;
                if (r < r1) {  // (!vec: guarded scalar loads packed into the same bits, zeros past OC)
                    xr[u] = load_raw<T>(inp + (size_t)r * OC + col, vec, ncol);
                    dr[u] = load_raw<T>(dout + (size_t)r * OC + col, vec, ncol);
                }
            }
#pragma unroll
            for (int u = 0; u < GELU_CS_UNROLL; u++) {
                const int r = n + 8 * u;
                if (r < r1) {
                    float x[V], d[V];
                    Vec16<T>::unpack(x, xr[u]);
                    Vec16<T>::unpack(d, dr[u]);
                    if constexpr (RC) {
                        float gx[V];
#pragma unroll
                        for (int k = 0; k < V; k++) gx[k] = gelu_fwd_as<T>(x[k]);
                        store_vec<T>(gout + (size_t)r * OC + col, gx, vec, ncol);
                    }
#pragma unroll
                    for (int k = 0; k < V; k++) x[k] = gelu_bwd_as<T>(x[k], d[k]);
                    round_to<T, V>(x);
                    // (__fadd_rn: never contracted with gelu_bwd's last multiply into an FMA, which in fp32
                    // would add the unrounded product instead of dinp as stored)
#pragma unroll
                    for (int k = 0; k < V; k++) s[k] = __fadd_rn(s[k], x[k]);  // (past OC: 0 * gelu'(0) = 0, never stored)
                    store_vec<T>(dinp + (size_t)r * OC + col, x, vec, ncol);
                }
            }
        }
    }
    // the 8 row-lanes in order into this chunk's partial row
    sum_row_lanes<V>(s, sh, tx, ty);
    if (ty == 0 && ncol > 0) {
        float* p = partial + (size_t)blockIdx.y * OC + col;
#pragma unroll
        for (int k = 0; k < V; k++) if (k < ncol) p[k] = s[k];
    }
    if (!last_block_ticket(counters, is_last)) return;
    // the last block of this column block: chunks ty, ty+8, ... then the row-lanes in order
#pragma unroll
    for (int k = 0; k < V; k++) s[k] = 0.0f;
    // (plain loads, 16 bytes at a time where the row allows: the ticket's fences order them after the
    // other blocks' partial stores, as in matmul_backward_bias 4, whose ld.global.cg loads were strong
    // loads that ptxas kept fewer of in flight; these were 4-byte ld.global.cg loads)
    if (ncol > 0) {
#pragma unroll 4
        for (int c = ty; c < (int)gridDim.y; c += 8) {  // (unrolled: several chunks' loads in flight)
            const float* p = partial + (size_t)c * OC + col;
            if (vec) {
#pragma unroll
                for (int q = 0; q < V / 4; q++) {
                    const float4 v = *reinterpret_cast<const float4*>(p + 4 * q);
                    s[4 * q] += v.x; s[4 * q + 1] += v.y; s[4 * q + 2] += v.z; s[4 * q + 3] += v.w;
                }
            } else {
#pragma unroll
                for (int k = 0; k < V; k++) if (k < ncol) s[k] += p[k];
            }
        }
    }
    sum_row_lanes<V>(s, sh, tx, ty);
    if (ty == 0 && ncol > 0) {
#pragma unroll
        for (int k = 0; k < V; k++)
            if (k < ncol) colsum[col + k] = from_f32<T>(to_f32(colsum[col + k]) + s[k]);
    }
    if (tx == 0 && ty == 0) counters[blockIdx.x] = 0u;
}

extern "C" __global__ void gelu_backward_kernel2_colsum(float* dinp, float* colsum, float* partial,
        unsigned int* counters, const float* inp, const float* dout, int rows, int OC, int rows_per_chunk) {
    LLMC_PDL_WAIT();
    gelu_backward_colsum_t<float>(dinp, colsum, partial, counters, inp, dout, rows, OC, rows_per_chunk);
}
// (256, 4): 63 registers, 4 blocks (32 warps) an SM, each warp with GELU_CS_UNROLL (2) rows of 2 x 512
// bytes in flight (at 4 rows: 64 registers; unbounded it took 72, 3 blocks); the fp32 build: 48 by itself
extern "C" __global__ void __launch_bounds__(256, 4) gelu_backward_kernel2_colsum_bf16(bf16* dinp, bf16* colsum, float* partial,
        unsigned int* counters, const bf16* inp, const bf16* dout, int rows, int OC, int rows_per_chunk) {
    LLMC_PDL_WAIT();
    gelu_backward_colsum_t<bf16>(dinp, colsum, partial, counters, inp, dout, rows, OC, rows_per_chunk);
}
// the recompute form (RC above): gout = gelu(inp) too
extern "C" __global__ void gelu_backward_kernel2_colsum_rc(float* dinp, float* colsum, float* gout, float* partial,
        unsigned int* counters, const float* inp, const float* dout, int rows, int OC, int rows_per_chunk) {
    LLMC_PDL_WAIT();
    gelu_backward_colsum_t<float, true>(dinp, colsum, partial, counters, inp, dout, rows, OC, rows_per_chunk, gout);
}
// (256, 3): the GELU's 8 more values and the second store need more than 64 registers (69 at 2 rows, 80
// at 4, where ptxas spilled 324 bytes at (256, 4)); 3 blocks an SM, each warp 2 rows of 3 x 512 bytes in flight.
// GELU_RC_MIN_BLOCKS: the bound's blocks an SM, a lab knob (--define gelu:GELU_RC_MIN_BLOCKS=4: 64 registers
// at 2 rows, no spills)
#ifndef GELU_RC_MIN_BLOCKS
#define GELU_RC_MIN_BLOCKS 3
#endif
extern "C" __global__ void __launch_bounds__(256, GELU_RC_MIN_BLOCKS) gelu_backward_kernel2_colsum_rc_bf16(bf16* dinp, bf16* colsum,
        bf16* gout, float* partial, unsigned int* counters, const bf16* inp, const bf16* dout, int rows, int OC,
        int rows_per_chunk) {
    LLMC_PDL_WAIT();
    gelu_backward_colsum_t<bf16, true>(dinp, colsum, partial, counters, inp, dout, rows, OC, rows_per_chunk, gout);
}
