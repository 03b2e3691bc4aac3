// Causal softmax forward/backward over (BNH, T, T) score matrices: the softmax inside the composite
// attention (attention_forward / attention_backward variant 1, llmc/ops/attention.py), which runs
// q k^T and att v in the GEMM engines (cuda/gemm.cu) around these kernels.
//
// softmax_forward: att(BNH,T,T) = causal softmax(scale * preatt(BNH,T,T)); s > t written 0.
//   1  one thread per row, three serial passes (max, sum, write); uncoalesced, the plainest
//   2  one block per row, shared-memory tree reductions for max and sum
//   3  one warp per row, shuffle reductions, three passes over the row
//   4  one warp per row, online softmax (Milakov & Gimelshein): max and sum in one pass, then write
//   5  4 + float4 loads/stores (T % 4 == 0)
//   6  one warp per row, the row's lower triangle held in registers: one DRAM read of s <= t,
//      streaming float4 stores of the whole row (T % 4 == 0, T <= 2048)
// softmax_backward: dpreatt = scale * att * (datt - sum_s att*datt) on s <= t, 0 above.
//   1  one thread per row, two serial passes
//   2  one block per row, shared-memory tree reduction for the dot product
//   3  one warp per row, shuffle reduction, two passes over the row
//   4  one block per row, the row cached in shared memory: one DRAM read (any T)
//   5  3 + float4 loads/stores (T % 4 == 0)
//   6  one warp per row, lower triangle of att and datt held in registers: one DRAM read of
//      s <= t, streaming float4 stores (T % 4 == 0, T <= 2048). Its _lower_ entry points store only
//      s <= t (the composite's pre-zeroed scratch); 403 -> 302 MB at BNH=48, T=1024.
//
// Byte counts (fp32) for one softmax pass at BNH=48, T=1024: the lower triangle is 48*T(T+1)/2*4 =
// 101 MB, a full matrix 201 MB. Forward must read the triangle once and write the full matrix
// (302 MB, 0.10 ms at 2.98 TB/s); backward reads two triangles and writes one full matrix
// (403 MB, 0.135 ms). Every variant reads only s <= t: what the causal mask throws away is never loaded.
#include "common.cuh"

// ----------------------------------------------------------------------------------------------
// softmax_forward

// Row r of the (BNH*T) rows is time step t = r % T; it takes part in s = 0..t.
extern "C" __global__ void softmax_forward_kernel1(float* att, const float* preatt, int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    // att, preatt: (BNH, T, T)
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= BNH * T) return;
    int t = row % T;
    const float* x = preatt + (size_t)row * T;
    float* y = att + (size_t)row * T;
    // scale > 0, so max(scale * x) = scale * max(x): subtract the raw max before scaling
    float maxv = -FLT_MAX;
    for (int s = 0; s <= t; s++) maxv = fmaxf(maxv, x[s]);
    float sum = 0.0f;
    for (int s = 0; s <= t; s++) sum += expf(scale * (x[s] - maxv));
    float inv = 1.0f / sum;
    for (int s = 0; s <= t; s++) y[s] = expf(scale * (x[s] - maxv)) * inv;
    for (int s = t + 1; s < T; s++) y[s] = 0.0f;
}

// blockDim.x must be a power of two (the tree halves it); dynamic smem = blockDim.x floats.
extern "C" __global__ void softmax_forward_kernel2(float* att, const float* preatt, int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    extern __shared__ float buf[];
    int row = blockIdx.x, tid = threadIdx.x, t = row % T;
    const float* x = preatt + (size_t)row * T;
    float* y = att + (size_t)row * T;
    float maxv = -FLT_MAX;
    for (int s = tid; s <= t; s += blockDim.x) maxv = fmaxf(maxv, x[s]);
    buf[tid] = maxv;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) buf[tid] = fmaxf(buf[tid], buf[tid + stride]);
        __syncthreads();
    }
    maxv = buf[0];
    __syncthreads();  // everyone has read buf[0] before the sum overwrites it
    float sum = 0.0f;
    for (int s = tid; s <= t; s += blockDim.x) sum += expf(scale * (x[s] - maxv));
    buf[tid] = sum;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) buf[tid] += buf[tid + stride];
        __syncthreads();
    }
    float inv = 1.0f / buf[0];
    for (int s = tid; s < T; s += blockDim.x) y[s] = (s <= t) ? expf(scale * (x[s] - maxv)) * inv : 0.0f;
}

// one warp per row: 32 lanes read consecutive elements (coalesced), reductions by shuffles.
extern "C" __global__ void softmax_forward_kernel3(float* att, const float* preatt, int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (row >= BNH * T) return;  // the whole warp leaves together
    int t = row % T;
    const float* x = preatt + (size_t)row * T;
    float* y = att + (size_t)row * T;
    float maxv = -FLT_MAX;
    for (int s = lane; s <= t; s += WARP_SIZE) maxv = fmaxf(maxv, x[s]);
    maxv = warp_reduce_max(maxv);
    float sum = 0.0f;
    for (int s = lane; s <= t; s += WARP_SIZE) sum += expf(scale * (x[s] - maxv));
    float inv = 1.0f / warp_reduce_sum(sum);
    for (int s = lane; s < T; s += WARP_SIZE) y[s] = (s <= t) ? expf(scale * (x[s] - maxv)) * inv : 0.0f;
}

// Online softmax: each lane keeps a running max m and a sum d of exp(scale*(x - m)), rescaling d
// when m grows. One pass yields both; the lanes' (m, d) pairs merge the same way.
__device__ __forceinline__ void online_update(float& m, float& d, float v, float scale) {
    if (v > m) { d = d * expf(scale * (m - v)) + 1.0f; m = v; }
    else       { d += expf(scale * (v - m)); }
}
__device__ __forceinline__ void online_merge_warp(float& m, float& d, float scale) {
    // an empty lane has (m, d) = (-FLT_MAX, 0): its exp factor underflows to 0 and 0*0 stays 0
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), d2 = __shfl_xor_sync(0xffffffffu, d, o);
        float mn = fmaxf(m, m2);
        d = d * expf(scale * (m - mn)) + d2 * expf(scale * (m2 - mn));
        m = mn;
    }
}

extern "C" __global__ void softmax_forward_kernel4(float* att, const float* preatt, int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (row >= BNH * T) return;
    int t = row % T;
    const float* x = preatt + (size_t)row * T;
    float* y = att + (size_t)row * T;
    float m = -FLT_MAX, d = 0.0f;
    for (int s = lane; s <= t; s += WARP_SIZE) online_update(m, d, x[s], scale);
    online_merge_warp(m, d, scale);
    float inv = 1.0f / d;
    // second pass: the row was just read by this warp, so these loads mostly hit L1/L2
    for (int s = lane; s < T; s += WARP_SIZE) y[s] = (s <= t) ? expf(scale * (x[s] - m)) * inv : 0.0f;
}

// 4 with 16-byte accesses. Rows start 16-byte aligned because T % 4 == 0 (the launcher checks).
// The float4 that holds s = t may also hold up to 3 elements s > t: they are masked by selects, so
// whatever is stored there (even NaN) never reaches the arithmetic.
extern "C" __global__ void softmax_forward_kernel5(float* att, const float* preatt, int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (row >= BNH * T) return;
    int t = row % T;
    const float* x = preatt + (size_t)row * T;
    float* y = att + (size_t)row * T;
    int n4 = t / 4 + 1, T4 = T / 4;  // float4s that hold some s <= t; float4s per row
    float m = -FLT_MAX, d = 0.0f;
    for (int i = lane; i < n4; i += WARP_SIZE) {
        float4 v = load4(x + 4 * i);
        int s = 4 * i;
        online_update(m, d, v.x, scale);
        if (s + 1 <= t) online_update(m, d, v.y, scale);
        if (s + 2 <= t) online_update(m, d, v.z, scale);
        if (s + 3 <= t) online_update(m, d, v.w, scale);
    }
    online_merge_warp(m, d, scale);
    float inv = 1.0f / d;
    for (int i = lane; i < T4; i += WARP_SIZE) {
        int s = 4 * i;
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < n4) {
            float4 v = load4(x + s);
            o.x = expf(scale * (v.x - m)) * inv;
            o.y = (s + 1 <= t) ? expf(scale * (v.y - m)) * inv : 0.0f;
            o.z = (s + 2 <= t) ? expf(scale * (v.z - m)) * inv : 0.0f;
            o.w = (s + 3 <= t) ? expf(scale * (v.w - m)) * inv : 0.0f;
        }
        store4(y + s, o);
    }
}

// 6: the row's lower triangle lives in registers between the reductions, so DRAM sees exactly one
// read of s <= t and one write of the full row. Lane l holds float4 number j*32 + l (j < NV4), so
// a warp covers 128*NV4 columns; the launcher picks the smallest NV4 with 128*NV4 >= T. All
// register indices are compile-time constants after unrolling (no local memory).
template <int NV4>
__device__ __forceinline__ void softmax_forward6(float* att, const float* preatt, int BNH, int T, float scale) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (row >= BNH * T) return;
    int t = row % T;
    const float* x = preatt + (size_t)row * T;
    float* y = att + (size_t)row * T;
    int n4 = t / 4 + 1, T4 = T / 4;
    float v[4 * NV4];
    // issue every load before the first use: up to NV4 16-byte loads in flight per lane
#pragma unroll
    for (int j = 0; j < NV4; j++) {
        int i = j * WARP_SIZE + lane;
        float4 f = make_float4(-FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX);
        if (i < n4) f = __ldcs(reinterpret_cast<const float4*>(x) + i);  // read once: stream it
        v[4 * j + 0] = f.x; v[4 * j + 1] = f.y; v[4 * j + 2] = f.z; v[4 * j + 3] = f.w;
    }
    float maxv = -FLT_MAX;
#pragma unroll
    for (int j = 0; j < NV4; j++) {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int s = 4 * (j * WARP_SIZE + lane) + c;
            v[4 * j + c] = (s <= t) ? v[4 * j + c] : -FLT_MAX;  // mask s > t by a select (NaN-safe)
            maxv = fmaxf(maxv, v[4 * j + c]);
        }
    }
    maxv = warp_reduce_max(maxv);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NV4; j++) {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int s = 4 * (j * WARP_SIZE + lane) + c;
            float e = (s <= t) ? expf(scale * (v[4 * j + c] - maxv)) : 0.0f;
            v[4 * j + c] = e;
            sum += e;
        }
    }
    float inv = 1.0f / warp_reduce_sum(sum);
#pragma unroll
    for (int j = 0; j < NV4; j++) {
        int i = j * WARP_SIZE + lane;
        if (i < T4)  // zeros above the diagonal come for free: those e are 0
            __stcs(reinterpret_cast<float4*>(y) + i, make_float4(v[4 * j] * inv, v[4 * j + 1] * inv,
                                                                 v[4 * j + 2] * inv, v[4 * j + 3] * inv));
    }
}
#define SOFTMAX_FORWARD6(NV4) \
    extern "C" __global__ void softmax_forward_kernel6_nv##NV4(float* att, const float* preatt, int BNH, int T, float scale) \
    { LLMC_PDL_WAIT(); softmax_forward6<NV4>(att, preatt, BNH, T, scale); }
SOFTMAX_FORWARD6(1)
SOFTMAX_FORWARD6(2)
SOFTMAX_FORWARD6(4)
SOFTMAX_FORWARD6(8)
SOFTMAX_FORWARD6(16)

// ----------------------------------------------------------------------------------------------
// softmax_backward: with a = att, g = datt on s <= t, dpreatt = scale * a * (g - sum_s a*g).
// (The softmax Jacobian times g; the scale is the chain rule through scale * preatt.)

extern "C" __global__ void softmax_backward_kernel1(float* dpreatt, const float* datt, const float* att,
                                                    int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= BNH * T) return;
    int t = row % T;
    size_t off = (size_t)row * T;
    const float* a = att + off; const float* g = datt + off; float* dx = dpreatt + off;
    float dot = 0.0f;
    for (int s = 0; s <= t; s++) dot += a[s] * g[s];
    for (int s = 0; s <= t; s++) dx[s] = scale * a[s] * (g[s] - dot);
    for (int s = t + 1; s < T; s++) dx[s] = 0.0f;
}

// blockDim.x a power of two; dynamic smem = blockDim.x floats.
extern "C" __global__ void softmax_backward_kernel2(float* dpreatt, const float* datt, const float* att,
                                                    int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    extern __shared__ float buf[];
    int row = blockIdx.x, tid = threadIdx.x, t = row % T;
    size_t off = (size_t)row * T;
    const float* a = att + off; const float* g = datt + off; float* dx = dpreatt + off;
    float dot = 0.0f;
    for (int s = tid; s <= t; s += blockDim.x) dot += a[s] * g[s];
    buf[tid] = dot;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) buf[tid] += buf[tid + stride];
        __syncthreads();
    }
    dot = buf[0];
    for (int s = tid; s < T; s += blockDim.x) dx[s] = (s <= t) ? scale * a[s] * (g[s] - dot) : 0.0f;
}

extern "C" __global__ void softmax_backward_kernel3(float* dpreatt, const float* datt, const float* att,
                                                    int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (row >= BNH * T) return;
    int t = row % T;
    size_t off = (size_t)row * T;
    const float* a = att + off; const float* g = datt + off; float* dx = dpreatt + off;
    float dot = 0.0f;
    for (int s = lane; s <= t; s += WARP_SIZE) dot += a[s] * g[s];
    dot = warp_reduce_sum(dot);
    for (int s = lane; s < T; s += WARP_SIZE) dx[s] = (s <= t) ? scale * a[s] * (g[s] - dot) : 0.0f;
}

// one block per row, the row's s <= t part of att and datt staged in shared memory (dynamic smem
// = 2*T floats), so global memory is read exactly once whatever T is.
extern "C" __global__ void softmax_backward_kernel4(float* dpreatt, const float* datt, const float* att,
                                                    int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    extern __shared__ float sm[];
    float* sa = sm;      // (T)
    float* sg = sm + T;  // (T)
    __shared__ float red[WARP_SIZE];
    int row = blockIdx.x, tid = threadIdx.x, t = row % T;
    size_t off = (size_t)row * T;
    const float* a = att + off; const float* g = datt + off; float* dx = dpreatt + off;
    float dot = 0.0f;
    for (int s = tid; s <= t; s += blockDim.x) {
        float av = a[s], gv = g[s];
        sa[s] = av; sg[s] = gv;  // each thread re-reads only what it wrote: no barrier needed for sa/sg
        dot += av * gv;
    }
    dot = block_reduce_sum(dot, red);
    for (int s = tid; s < T; s += blockDim.x) dx[s] = (s <= t) ? scale * sa[s] * (sg[s] - dot) : 0.0f;
}

// 3 with 16-byte accesses (T % 4 == 0).
extern "C" __global__ void softmax_backward_kernel5(float* dpreatt, const float* datt, const float* att,
                                                    int BNH, int T, float scale) {
    LLMC_PDL_WAIT();
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (row >= BNH * T) return;
    int t = row % T;
    size_t off = (size_t)row * T;
    const float* a = att + off; const float* g = datt + off; float* dx = dpreatt + off;
    int n4 = t / 4 + 1, T4 = T / 4;
    float dot = 0.0f;
    for (int i = lane; i < n4; i += WARP_SIZE) {
        float4 av = load4(a + 4 * i), gv = load4(g + 4 * i);
        int s = 4 * i;
        dot += av.x * gv.x;
        dot += (s + 1 <= t) ? av.y * gv.y : 0.0f;
        dot += (s + 2 <= t) ? av.z * gv.z : 0.0f;
        dot += (s + 3 <= t) ? av.w * gv.w : 0.0f;
    }
    dot = warp_reduce_sum(dot);
    for (int i = lane; i < T4; i += WARP_SIZE) {
        int s = 4 * i;
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < n4) {
            float4 av = load4(a + s), gv = load4(g + s);
            o.x = scale * av.x * (gv.x - dot);
            o.y = (s + 1 <= t) ? scale * av.y * (gv.y - dot) : 0.0f;
            o.z = (s + 2 <= t) ? scale * av.z * (gv.z - dot) : 0.0f;
            o.w = (s + 3 <= t) ? scale * av.w * (gv.w - dot) : 0.0f;
        }
        store4(dx + s, o);
    }
}

// 6: like softmax_forward6, both inputs' lower triangles in registers (8*NV4 floats per lane).
// FULL = false writes only the float4s that hold some s <= t (a third less traffic at T = 1024):
// used by the attention composite, whose dpreatt scratch is zeroed once at build and written by
// nothing else, so the zeros above the diagonal are already there. Not an op variant of its own
// (the op's contract writes every element).
template <int NV4, bool FULL>
__device__ __forceinline__ void softmax_backward6(float* dpreatt, const float* datt, const float* att,
                                                  int BNH, int T, float scale) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (row >= BNH * T) return;
    int t = row % T;
    size_t off = (size_t)row * T;
    const float4* a4 = reinterpret_cast<const float4*>(att + off);
    const float4* g4 = reinterpret_cast<const float4*>(datt + off);
    float4* dx4 = reinterpret_cast<float4*>(dpreatt + off);
    int n4 = t / 4 + 1, T4 = T / 4;
    float a[4 * NV4], g[4 * NV4];
#pragma unroll
    for (int j = 0; j < NV4; j++) {
        int i = j * WARP_SIZE + lane;
        float4 fa = make_float4(0.0f, 0.0f, 0.0f, 0.0f), fg = fa;
        if (i < n4) { fa = __ldcs(a4 + i); fg = __ldcs(g4 + i); }
        a[4 * j + 0] = fa.x; a[4 * j + 1] = fa.y; a[4 * j + 2] = fa.z; a[4 * j + 3] = fa.w;
        g[4 * j + 0] = fg.x; g[4 * j + 1] = fg.y; g[4 * j + 2] = fg.z; g[4 * j + 3] = fg.w;
    }
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < NV4; j++) {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int s = 4 * (j * WARP_SIZE + lane) + c;
            a[4 * j + c] = (s <= t) ? a[4 * j + c] : 0.0f;  // select, so garbage above t never leaks
            g[4 * j + c] = (s <= t) ? g[4 * j + c] : 0.0f;
            dot += a[4 * j + c] * g[4 * j + c];
        }
    }
    dot = warp_reduce_sum(dot);
#pragma unroll
    for (int j = 0; j < NV4; j++) {
        int i = j * WARP_SIZE + lane;
        if (FULL ? i < T4 : i < n4)  // a = 0 above t, so these products are exact zeros there
            __stcs(dx4 + i, make_float4(scale * a[4 * j] * (g[4 * j] - dot), scale * a[4 * j + 1] * (g[4 * j + 1] - dot),
                                        scale * a[4 * j + 2] * (g[4 * j + 2] - dot), scale * a[4 * j + 3] * (g[4 * j + 3] - dot)));
    }
}
#define SOFTMAX_BACKWARD6(NV4) \
    extern "C" __global__ void softmax_backward_kernel6_nv##NV4(float* dpreatt, const float* datt, const float* att, \
                                                              int BNH, int T, float scale) \
    { LLMC_PDL_WAIT(); softmax_backward6<NV4, true>(dpreatt, datt, att, BNH, T, scale); } \
    extern "C" __global__ void softmax_backward_kernel6_lower_nv##NV4(float* dpreatt, const float* datt, const float* att, \
                                                                    int BNH, int T, float scale) \
    { LLMC_PDL_WAIT(); softmax_backward6<NV4, false>(dpreatt, datt, att, BNH, T, scale); }
SOFTMAX_BACKWARD6(1)
SOFTMAX_BACKWARD6(2)
SOFTMAX_BACKWARD6(4)
SOFTMAX_BACKWARD6(8)
SOFTMAX_BACKWARD6(16)
