// Attention: causal softmax forward/backward over (BNH, T, T) score matrices, the permutes that
// move q, k, v between the model's (B, T, 3, NH, hs) layout and per-head (3, B, NH, T, hs), and a
// decode kernel (one new query per sequence over a KV cache) for sampling.
// The matrix products (q k^T, att v and their gradients) run in the team's batched GEMM
// (cuda/matmul.cu through llmc.ops.matmul.gemm_build); llmc/ops/attention.py composes them.
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
// permutes (helpers of the composite, no variant flag):
//   permute_kernel1/2    dst(S,B,NH,T,hs) <- src(B,T,S,NH,hs); 1 scalar, 2 float4 (hs % 4 == 0)
//   unpermute_kernel1/2  dst(B,T,S,NH,hs) <- src(S,B,NH,T,hs); the inverse
// decode:
//   attention_decode_kernel1  one block per (b, h): scores in shared memory, block softmax, att @ v
//   attention_decode_kernel2  split over chunks of 64 keys (B*NH x maxT/64 blocks, a thread per key),
//                             + attention_decode_combine_kernel2 merging the chunks' softmax states
//   (both take the new token's q, k, v straight from the qkv matmul's (B,3C) output: its k, v are
//    used for position pos and written into the caches there, so no separate append launch)
//   attention_kv_fill_kernel1    after the prompt's forward pass: k, v of positions 0..T-1 from the
//                                forward's qkvr (q|k|v, each (B,NH,T,hs)) into the caches
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
    { softmax_forward6<NV4>(att, preatt, BNH, T, scale); }
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
    { softmax_backward6<NV4, true>(dpreatt, datt, att, BNH, T, scale); } \
    extern "C" __global__ void softmax_backward_kernel6_lower_nv##NV4(float* dpreatt, const float* datt, const float* att, \
                                                                    int BNH, int T, float scale) \
    { softmax_backward6<NV4, false>(dpreatt, datt, att, BNH, T, scale); }
SOFTMAX_BACKWARD6(1)
SOFTMAX_BACKWARD6(2)
SOFTMAX_BACKWARD6(4)
SOFTMAX_BACKWARD6(8)
SOFTMAX_BACKWARD6(16)

// ----------------------------------------------------------------------------------------------
// permutes between (B, T, S, NH, hs) and (S, B, NH, T, hs); S = 3 for q|k|v, 1 for y.
// One thread per element (or float4) of the destination, so writes are coalesced; reads are
// coalesced within runs of hs contiguous floats. Pure data movement: 2 * bytes of the tensor.

template <typename V>
__device__ __forceinline__ void permute_impl(V* dst, const V* src, int B, int T, int S, int NH, int hsv) {
    // dst (S, B, NH, T, hsv) <- src (B, T, S, NH, hsv); hsv = hs in units of V
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= S * B * NH * T * hsv) return;
    int d = idx % hsv, r = idx / hsv;
    int t = r % T; r /= T;
    int h = r % NH; r /= NH;
    int b = r % B; int s = r / B;
    dst[idx] = src[(((size_t)(b * T + t) * S + s) * NH + h) * hsv + d];
}
template <typename V>
__device__ __forceinline__ void unpermute_impl(V* dst, const V* src, int B, int T, int S, int NH, int hsv) {
    // dst (B, T, S, NH, hsv) <- src (S, B, NH, T, hsv)
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= S * B * NH * T * hsv) return;
    int d = idx % hsv, r = idx / hsv;
    int h = r % NH; r /= NH;
    int s = r % S; r /= S;
    int t = r % T; int b = r / T;
    dst[idx] = src[(((size_t)(s * B + b) * NH + h) * T + t) * hsv + d];
}

extern "C" __global__ void permute_kernel1(float* dst, const float* src, int B, int T, int S, int NH, int hs) {
    permute_impl<float>(dst, src, B, T, S, NH, hs);
}
extern "C" __global__ void permute_kernel2(float* dst, const float* src, int B, int T, int S, int NH, int hs) {
    permute_impl<float4>(reinterpret_cast<float4*>(dst), reinterpret_cast<const float4*>(src), B, T, S, NH, hs / 4);
}
extern "C" __global__ void unpermute_kernel1(float* dst, const float* src, int B, int T, int S, int NH, int hs) {
    unpermute_impl<float>(dst, src, B, T, S, NH, hs);
}
extern "C" __global__ void unpermute_kernel2(float* dst, const float* src, int B, int T, int S, int NH, int hs) {
    unpermute_impl<float4>(reinterpret_cast<float4*>(dst), reinterpret_cast<const float4*>(src), B, T, S, NH, hs / 4);
}

// ----------------------------------------------------------------------------------------------
// decode: one new query per sequence at position pos over cached keys/values 0..pos. The decode
// kernels read pos from device memory (posp), so that a CUDA graph captured once replays every step.
// out (B, C); qkv (B, 3C): q | k | v of the new token, heads side by side (the qkv matmul's output);
// kcache/vcache (B, NH, maxT, hs) hold positions 0..pos-1. The new k, v are read from qkv for
// position pos and written into the caches at pos by the one block (or chunk) that covers pos;
// nothing else reads the caches at pos during the launch.
// Version 1: one block per (b, h). Dynamic smem: hs (q) + maxT (scores) + blockDim.x floats.
extern "C" __global__ void attention_decode_kernel1(float* out, const float* qkv, float* kcache, float* vcache,
                                                    const int* posp, int B, int NH, int hs, int maxT, float scale) {
    extern __shared__ float sm[];
    int pos = *posp;
    float* sq = sm;             // (hs)
    float* sp = sm + hs;        // (maxT) scores, then probabilities
    float* part = sp + maxT;    // (blockDim.x) partial sums of att @ v
    __shared__ float red[WARP_SIZE];
    int bh = blockIdx.x, b = bh / NH, h = bh % NH, C = NH * hs;
    int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, nwarps = blockDim.x / WARP_SIZE;
    const float* k = kcache + (size_t)bh * maxT * hs;
    const float* v = vcache + (size_t)bh * maxT * hs;
    const float* row = qkv + (size_t)b * 3 * C + h * hs;  // q; + C: the new k; + 2C: the new v
    for (int d = tid; d < hs; d += blockDim.x) {
        sq[d] = row[d] * scale;
        kcache[((size_t)bh * maxT + pos) * hs + d] = row[C + d];      // append (read from qkv below)
        vcache[((size_t)bh * maxT + pos) * hs + d] = row[2 * C + d];
    }
    __syncthreads();
    // scores: one warp per cached key, lanes across hs
    for (int s = warp; s <= pos; s += nwarps) {
        const float* kr = s == pos ? row + C : k + (size_t)s * hs;
        float dot = 0.0f;
        for (int d = lane; d < hs; d += WARP_SIZE) dot += sq[d] * kr[d];
        dot = warp_reduce_sum(dot);
        if (lane == 0) sp[s] = dot;
    }
    __syncthreads();
    float maxv = -FLT_MAX;
    for (int s = tid; s <= pos; s += blockDim.x) maxv = fmaxf(maxv, sp[s]);
    maxv = block_reduce_max(maxv, red);
    float sum = 0.0f;
    for (int s = tid; s <= pos; s += blockDim.x) { float e = expf(sp[s] - maxv); sp[s] = e; sum += e; }
    sum = block_reduce_sum(sum, red);  // its barriers also publish sp
    float inv = 1.0f / sum;
    // att @ v: G = blockDim.x / hs groups of threads (at least 1) split the keys; thread (g, d)
    // sums keys g, g+G, ...; then the G partials of each d are added.
    int G = max(1, (int)blockDim.x / hs);
    for (int i = tid; i < G * hs; i += blockDim.x) {
        int g = i / hs, d = i % hs;
        float acc = 0.0f;
        for (int s = g; s <= pos; s += G) acc += sp[s] * (s == pos ? row[2 * C + d] : v[(size_t)s * hs + d]);
        part[i] = acc;
    }
    __syncthreads();
    for (int d = tid; d < hs; d += blockDim.x) {
        float acc = 0.0f;
        for (int g = 0; g < G; g++) acc += part[g * hs + d];
        out[(size_t)b * C + h * hs + d] = acc * inv;
    }
}

// version 2, split over the keys ("flash decoding"): kernel 1 runs one block per (b, h), a dozen
// blocks at batch 1, each walking up to 1024 keys with one warp reduction per key: latency-bound.
// Here grid (B*NH, ceil(maxT/64)): block c takes keys 64c..64c+63 (those <= pos; blocks past pos
// return at once) with one thread per key (hs/4 independent float4 loads each, the dot product in
// registers), and writes its chunk's softmax state to part (B*NH, chunks, hs+2): the unnormalised
// sum over its keys of exp(score - m) * v (hs floats), then m (its max score) and l (the sum of
// exp(score - m)). attention_decode_combine_kernel2 rescales the chunks to the global max and
// normalises. Block: 128 threads (2 groups of hs for p @ v when hs = 64). hs % 4 == 0.
#define DECODE_CHUNK 64
extern "C" __global__ void __launch_bounds__(128) attention_decode_kernel2(float* part, const float* qkv,
        float* kcache, float* vcache, const int* posp, int B, int NH, int hs, int maxT, float scale) {
    extern __shared__ float4 sm4[];
    float* sq = reinterpret_cast<float*>(sm4);  // (hs) the scaled query
    float* sp = sq + hs;                        // (DECODE_CHUNK) scores, then exp(score - m)
    float* acc = sp + DECODE_CHUNK;             // (G * hs) partial sums of p @ v
    const int bh = blockIdx.x, chunk = blockIdx.y, pos = *posp, s0 = chunk * DECODE_CHUNK;
    if (s0 > pos) return;                       // the combine reads chunks 0..pos/64 only
    float* dst = part + ((size_t)bh * gridDim.y + chunk) * (hs + 2);
    const int n = min(pos + 1 - s0, DECODE_CHUNK);
    const int b = bh / NH, h = bh % NH, C = NH * hs, tid = threadIdx.x, hs4 = hs / 4;
    const float* k = kcache + ((size_t)bh * maxT + s0) * hs;
    const float* v = vcache + ((size_t)bh * maxT + s0) * hs;
    const float* row = qkv + (size_t)b * 3 * C + h * hs;  // q; + C: the new k; + 2C: the new v
    const int last = pos - s0;                            // the new token's index here, if < n
    for (int d = tid; d < hs; d += blockDim.x) {
        sq[d] = row[d] * scale;
        if (last < n) {                                   // this chunk covers pos: append
            kcache[((size_t)bh * maxT + pos) * hs + d] = row[C + d];
            vcache[((size_t)bh * maxT + pos) * hs + d] = row[2 * C + d];
        }
    }
    __syncthreads();
    const float4* sq4 = reinterpret_cast<const float4*>(sq);
    for (int s = tid; s < n; s += blockDim.x) {
        const float4* kr = reinterpret_cast<const float4*>(s == last ? row + C : k + (size_t)s * hs);
        float dot = 0.0f;
#pragma unroll 8
        for (int i = 0; i < hs4; i++) {
            const float4 kv = kr[i], qv = sq4[i];
            dot = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, fmaf(qv.z, kv.z, fmaf(qv.w, kv.w, dot))));
        }
        sp[s] = dot;
    }
    __syncthreads();
    if (tid < WARP_SIZE) {                      // max and sum over <= 64 scores: one warp
        float m = -FLT_MAX;
        for (int s = tid; s < n; s += WARP_SIZE) m = fmaxf(m, sp[s]);
        m = warp_reduce_max(m);
        float l = 0.0f;
        for (int s = tid; s < n; s += WARP_SIZE) { const float e = expf(sp[s] - m); sp[s] = e; l += e; }
        l = warp_reduce_sum(l);
        if (tid == 0) { dst[hs] = m; dst[hs + 1] = l; }
    }
    __syncthreads();
    const int G = max(1, (int)blockDim.x / hs);  // groups of hs threads split the chunk's keys
    for (int i = tid; i < G * hs; i += blockDim.x) {
        const int g = i / hs, d = i % hs;
        float a = 0.0f;
        for (int s = g; s < n; s += G) a = fmaf(sp[s], s == last ? row[2 * C + d] : v[(size_t)s * hs + d], a);
        acc[i] = a;
    }
    __syncthreads();
    for (int d = tid; d < hs; d += blockDim.x) {
        float a = 0.0f;
        for (int g = 0; g < G; g++) a += acc[g * hs + d];
        dst[d] = a;
    }
}

// Merge the chunks 0..pos/64 of each (b, h): out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c,
// M the largest m_c. One block per (b, h), a thread per channel of the head.
extern "C" __global__ void attention_decode_combine_kernel2(float* out, const float* part, const int* posp,
                                                            int NH, int hs, int chunks) {
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH, used = *posp / DECODE_CHUNK + 1;
    const float* p = part + (size_t)bh * chunks * (hs + 2);
    float M = -FLT_MAX;
    for (int c = 0; c < used; c++) M = fmaxf(M, p[(size_t)c * (hs + 2) + hs]);
    for (int d = threadIdx.x; d < hs; d += blockDim.x) {
        float L = 0.0f, a = 0.0f;
        for (int c = 0; c < used; c++) {
            const float* pc = p + (size_t)c * (hs + 2);
            const float w = expf(pc[hs] - M);
            L = fmaf(w, pc[hs + 1], L);
            a = fmaf(w, pc[d], a);
        }
        out[(size_t)b * NH * hs + h * hs + d] = a / L;
    }
}

// qkvr holds q | k | v, each (B, NH, T, hs) (what attention_forward saves); copy k and v into
// positions 0..T-1 of the caches (B, NH, maxT, hs). One thread per element of k.
extern "C" __global__ void attention_kv_fill_kernel1(float* kcache, float* vcache, const float* qkvr,
                                                     int B, int NH, int T, int hs, int maxT) {
    size_t n = (size_t)B * NH * T * hs;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    size_t d = i % hs, t = (i / hs) % T, bh = i / ((size_t)hs * T);
    size_t dst = (bh * maxT + t) * hs + d;
    kcache[dst] = qkvr[n + i];
    vcache[dst] = qkvr[2 * n + i];
}
