// ops.cu: RMS norm (rows and per-head), RoPE (NORM and NEOX), GLU (silu / gelu-tanh) and scale, float32.
// Formulas follow ggml: rms_norm then mul by the weight; rope theta = p * freq_scale * theta_scale^i with
// theta_scale = freq_base^(-2/n_rot) (as ggml-cuda's rope); ggml_gelu's tanh approximation.

// sum over the blockDim.x threads of one row (blockDim.x == 32, or blockDim.y == 1 when blockDim.x > 32)
__device__ __forceinline__ float row_sum(float s) {
    s = warp_sum(s);
    if (blockDim.x == WARP) return s;
    __shared__ float red[32];
    __shared__ float total;
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[w] = s;
    __syncthreads();
    if (threadIdx.x < WARP) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) total = v;
    }
    __syncthreads();
    return total;
}

// x (n_rows, n) -> out (n_rows, n) = x / sqrt(mean(x^2) + eps) * w (w may be null); out may be x.
// Rows are (blockIdx.x * blockDim.y + threadIdx.y), blockDim.x threads a row.
extern "C" __global__ void rms_norm_f32(const float* x, const float* __restrict__ w, float* out, int n_rows, int n,
                                        float eps) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const bool valid = row < n_rows;
    const float* xr = x + (size_t)(valid ? row : 0) * n;
    float s = 0.0f;
    if (valid)
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const float v = xr[j];
            s += v * v;
        }
    s = row_sum(s);
    if (!valid) return;
    const float scale = 1.0f / sqrtf(s / (float)n + eps);
    float* orow = out + (size_t)row * n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float v = xr[j] * scale;
        orow[j] = w ? v * w[j] : v;
    }
}

// The residual add and the next norm in one pass: sum = x + a (sum may be x), out = rms_norm(sum) * w (w may be
// null); the same threads, order and reduction as rms_norm_f32, so out equals rms_norm_f32 of the sum exactly.
extern "C" __global__ void add_rms_norm_f32(const float* x, const float* a, const float* __restrict__ w, float* sum,
                                            float* out, int n_rows, int n, float eps) {
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const bool valid = row < n_rows;
    const size_t off = (size_t)(valid ? row : 0) * n;
    float s = 0.0f;
    if (valid)
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const float v = x[off + j] + a[off + j];
            sum[off + j] = v;
            s += v * v;
        }
    s = row_sum(s);
    if (!valid) return;
    const float scale = 1.0f / sqrtf(s / (float)n + eps);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {  // each thread reads back what it wrote
        const float v = sum[off + j] * scale;
        out[off + j] = w ? v * w[j] : v;
    }
}

// rms_norm_f32 / add_rms_norm_f32 of rows of n = 4 V blockDim.x values (every array 16-byte aligned), one CTA
// a row: each thread loads its V float4s in one round and keeps them in registers (a decode step's single row
// otherwise pays a chain of dependent loads on one SM). With ADD, sum = x + a is written and normed; the two
// forms take the same sums in the same order, so the norm of add_rms equals rms_norm's of the sum exactly.
// With Q8, the normed row is also quantized as quantize_q8_1 (matvec_q8.cu) into xq, xm (the same values: a
// block of 32 is the float4s of 8 neighbouring lanes), for the q8 matvecs that read it next.
template <int V, bool ADD, bool Q8 = false>
__device__ __forceinline__ void rms_row_vec(const float* x, const float* a, const float* __restrict__ w, float* sum,
                                            float* out, int n, float eps, i8* __restrict__ xq = nullptr,
                                            float4* __restrict__ xm = nullptr) {
    const size_t off = (size_t)blockIdx.x * (n >> 2);
    float4 v[V];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = ((const float4*)x)[off + i];
        if constexpr (ADD) {
            const float4 b = ((const float4*)a)[off + i];
            v[k] = make_float4(v[k].x + b.x, v[k].y + b.y, v[k].z + b.z, v[k].w + b.w);
            ((float4*)sum)[off + i] = v[k];
        }
        s += v[k].x * v[k].x;
        s += v[k].y * v[k].y;
        s += v[k].z * v[k].z;
        s += v[k].w * v[k].w;
    }
    s = row_sum(s);
    const float scale = 1.0f / sqrtf(s / (float)n + eps);
#pragma unroll
    for (int k = 0; k < V; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        float4 o = make_float4(v[k].x * scale, v[k].y * scale, v[k].z * scale, v[k].w * scale);
        if (w) {
            const float4 g = ((const float4*)w)[i];
            o = make_float4(o.x * g.x, o.y * g.y, o.z * g.z, o.w * g.w);
        }
        ((float4*)out)[off + i] = o;
        if constexpr (Q8) {
            float amax = fmaxf(fmaxf(fabsf(o.x), fabsf(o.y)), fmaxf(fabsf(o.z), fabsf(o.w)));
#pragma unroll
            for (int m = 1; m < 8; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
            const float d = amax / 127.0f;
            const int q0 = amax == 0.0f ? 0 : __float2int_rn(o.x / d);
            const int q1 = amax == 0.0f ? 0 : __float2int_rn(o.y / d);
            const int q2 = amax == 0.0f ? 0 : __float2int_rn(o.z / d);
            const int q3 = amax == 0.0f ? 0 : __float2int_rn(o.w / d);
            ((char4*)xq)[off + i] = make_char4((signed char)q0, (signed char)q1, (signed char)q2, (signed char)q3);
            float qs = (float)(q0 + q1 + q2 + q3);  // exact: |sum| <= 16 * 127
            qs += __shfl_xor_sync(0xffffffffu, qs, 1);
            qs += __shfl_xor_sync(0xffffffffu, qs, 2);  // elements 0..15 of the block (lanes 0-3 of its 8)
            const float qs_hi = __shfl_down_sync(0xffffffffu, qs, 4);  // 16..31
            if ((threadIdx.x & 7) == 0) xm[(off + i) >> 3] = make_float4(d, qs, qs_hi, 0.0f);
        }
    }
}

#define RMS_VEC_ENTRIES(V)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_vec##V##_f32(                               \
        const float* x, const float* __restrict__ w, float* out, int n, float eps) {                        \
        rms_row_vec<V, false>(x, nullptr, w, nullptr, out, n, eps);                                         \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_vec##V##_f32(                           \
        const float* x, const float* a, const float* __restrict__ w, float* sum, float* out, int n,        \
        float eps) {                                                                                        \
        rms_row_vec<V, true>(x, a, w, sum, out, n, eps);                                                    \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_q8_vec##V##_f32(                            \
        const float* x, const float* __restrict__ w, float* out, int n, float eps, i8* __restrict__ xq,     \
        float4* __restrict__ xm) {                                                                          \
        rms_row_vec<V, false, true>(x, nullptr, w, nullptr, out, n, eps, xq, xm);                           \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_q8_vec##V##_f32(                        \
        const float* x, const float* a, const float* __restrict__ w, float* sum, float* out, int n,        \
        float eps, i8* __restrict__ xq, float4* __restrict__ xm) {                                          \
        rms_row_vec<V, true, true>(x, a, w, sum, out, n, eps, xq, xm);                                      \
    }
RMS_VEC_ENTRIES(1)
RMS_VEC_ENTRIES(2)
RMS_VEC_ENTRIES(4)
RMS_VEC_ENTRIES(8)

// pair i of a row at position p rotated from src into dst (may be src): NORM (2i, 2i+1), NEOX (i, i + half)
__device__ __forceinline__ void rope_pair(float* dst, const float* src, int p, int i, int half, float theta_scale,
                                          float freq_scale, int neox) {
    const float theta = freq_scale * ((float)p * powf(theta_scale, (float)i));
    float sn, cs;
    sincosf(theta, &sn, &cs);
    const int i0 = neox ? i : 2 * i;
    const int i1 = neox ? i + half : 2 * i + 1;
    const float x0 = src[i0], x1 = src[i1];
    dst[i0] = x0 * cs - x1 * sn;
    dst[i1] = x0 * sn + x1 * cs;
}

// In place: x (n_tok, n_head, head_dim); pair i < n_rot / 2 of head h of token t, one thread each.
// NORM rotates (x[2i], x[2i+1]), NEOX (x[i], x[i + n_rot/2]); dims >= n_rot are left as they are.
extern "C" __global__ void rope_f32(float* x, const i32* __restrict__ pos, int n_tok, int n_head, int head_dim,
                                    int n_rot, float theta_scale, float freq_scale, int neox) {
    const int half = n_rot >> 1;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_tok * n_head * half) return;
    const int i = (int)(idx % half);
    const long long th = idx / half;
    const int t = (int)(th / n_head);
    float* xr = x + th * head_dim;
    rope_pair(xr, xr, pos[t], i, half, theta_scale, freq_scale, neox);
}

// rope_f32 of q (n_tok, n_head, head_dim) and k (n_tok, n_head_kv, head_dim) in one launch: the same pairs, the
// same rotation (equal to two rope_f32 launches exactly); head h < n_head of token t is q's, the rest k's.
extern "C" __global__ void rope_qk_f32(float* q, float* k, const i32* __restrict__ pos, int n_tok, int n_head,
                                       int n_head_kv, int head_dim, int n_rot, float theta_scale, float freq_scale,
                                       int neox) {
    const int half = n_rot >> 1, heads = n_head + n_head_kv;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_tok * heads * half) return;
    const int i = (int)(idx % half);
    const long long th = idx / half;
    const int t = (int)(th / heads), h = (int)(th - (long long)t * heads);
    float* xr = h < n_head ? q + ((long long)t * n_head + h) * head_dim
                           : k + ((long long)t * n_head_kv + (h - n_head)) * head_dim;
    rope_pair(xr, xr, pos[t], i, half, theta_scale, freq_scale, neox);
}

// QK-norm and RoPE of q and k in one launch, in place: each head row of q (n_tok, n_head, hd) and k (n_tok,
// n_head_kv, hd) rms-normed with its weight (wq or wk, hd each), then rotated as rope_f32. A warp a row: the same
// sums in the same order as rms_norm_f32's warp rows and the same rotation, so the result equals rms_norm_heads
// then rope exactly; the normed row passes through shared memory for the rotation's pairs. 8 rows a CTA.
#define QKNR_MAX_D 256
extern "C" __global__ void __launch_bounds__(256) qk_norm_rope_f32(float* q, float* k, const float* __restrict__ wq,
                                                                   const float* __restrict__ wk,
                                                                   const i32* __restrict__ pos, int n_tok, int n_head,
                                                                   int n_head_kv, int hd, float eps, int n_rot,
                                                                   float theta_scale, float freq_scale, int neox) {
    __shared__ float buf[8][QKNR_MAX_D];
    const int heads = n_head + n_head_kv;
    const int row = blockIdx.x * 8 + threadIdx.y, lane = threadIdx.x;
    if (row >= n_tok * heads) return;  // a whole warp: only __syncwarp below
    const int t = row / heads, h = row - t * heads;
    float* xr = h < n_head ? q + ((size_t)t * n_head + h) * hd : k + ((size_t)t * n_head_kv + (h - n_head)) * hd;
    const float* w = h < n_head ? wq : wk;
    float s = 0.0f;
    for (int j = lane; j < hd; j += WARP) {
        const float v = xr[j];
        s += v * v;
    }
    s = warp_sum(s);
    const float scale = 1.0f / sqrtf(s / (float)hd + eps);
    float* b = buf[threadIdx.y];
    for (int j = lane; j < hd; j += WARP) b[j] = xr[j] * scale * w[j];
    __syncwarp();
    const int half = n_rot >> 1;
    for (int i = lane; i < half; i += WARP) rope_pair(xr, b, pos[t], i, half, theta_scale, freq_scale, neox);
    for (int j = n_rot + lane; j < hd; j += WARP) xr[j] = b[j];
}

// out = act(gate) * up (glu_act: act 0 silu, 1 gelu, tanh approximation as ggml_gelu, 2 swiglu_oai)
extern "C" __global__ void glu_f32(const float* __restrict__ gate, const float* __restrict__ up, float* out,
                                   long long n, int act) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = glu_act(gate[i], up[i], act);
}

// glu_f32 on float4s (n4 = n / 4, 16-byte aligned arrays), one float4 a thread: the 512 x 14336 batch is
// memory-bound and the grid-stride loop of glu_f32 (capped grid, 64-bit index math per element) issues 4x the loads
extern "C" __global__ void glu_f32x4(const float4* __restrict__ gate, const float4* __restrict__ up, float4* out,
                                     long long n4, int act) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float4 g = gate[i], u = up[i];
    out[i] = make_float4(glu_act(g.x, u.x, act), glu_act(g.y, u.y, act), glu_act(g.z, u.z, act),
                         glu_act(g.w, u.w, act));
}

extern "C" __global__ void scale_f32(const float* __restrict__ x, float* out, long long n, float s) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = x[i] * s;
}

// (value, index) of the larger of two candidates: the lower index among equal values; NaNs never win
__device__ __forceinline__ void argmax_take(float& best, int& bi, float v, int i) {
    if (v > best || (v == best && i < bi)) {
        best = v;
        bi = i;
    }
}

// ids[r] = the index of row r's largest value as a float (exact below 2^24), np.argmax's choice among equals (the
// lowest index); a row of -inf or NaN only gives 0. x (n_rows, n) f32; one CTA of 1024 threads a row.
extern "C" __global__ void __launch_bounds__(1024) argmax_rows_f32(const float* __restrict__ x, float* __restrict__ ids,
                                                                  int n) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* row = x + (size_t)blockIdx.x * n;
    float best = __int_as_float((int)0xff800000);  // -inf (NVRTC has no INFINITY)
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) argmax_take(best, bi, row[i], i);  // ascending i: first kept
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_take(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = bi;
    }
    __syncthreads();
    if (warp) return;
    best = lane < (int)(blockDim.x >> 5) ? sv[lane] : __int_as_float((int)0xff800000);
    bi = lane < (int)(blockDim.x >> 5) ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_take(best, bi, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, bi, o));
    if (lane == 0) ids[blockIdx.x] = (float)(bi == 0x7fffffff ? 0 : bi);
}
