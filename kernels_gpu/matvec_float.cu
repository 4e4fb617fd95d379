// matvec_float.cu: the body of the float matvec (matvec_float_entries.cu has its kernels): F32, F16 and BF16 weights
// (rows of plain values; ggml_fp16_t / ggml_bf16_t bits).
// The activations stay float32 (ggml's CPU rounds them to the weight type first; this is closer to exact).
// KIND: 0 = F32, 1 = F16, 2 = BF16. VEC: rows are 16-byte aligned, read in chunks of 8 values with 16-byte
// loads (F32: two), the tail (n_in % 8) one value at a time.

#define MVF_WARPS 8

template <int KIND>
__device__ __forceinline__ float fval(const u8* row, int i) {
    if constexpr (KIND == 0) return ((const float*)row)[i];
    else if constexpr (KIND == 1) return h2f(((const u16*)row)[i]);
    else return bf2f(((const u16*)row)[i]);
}

// the 8 values of chunk c (elements 8c .. 8c+7) of a 16-byte-aligned row
template <int KIND>
__device__ __forceinline__ void fchunk(const u8* row, int c, float (&v)[8]) {
    if constexpr (KIND == 0) {
        const float4 a = ((const float4*)row)[2 * c], b = ((const float4*)row)[2 * c + 1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        const uint4 q = ((const uint4*)row)[c];
        const u32 qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if constexpr (KIND == 1) {
                v[2 * k] = h2f((u16)(qw[k] & 0xffffu));
                v[2 * k + 1] = h2f((u16)(qw[k] >> 16));
            } else {
                v[2 * k] = __uint_as_float(qw[k] << 16);
                v[2 * k + 1] = __uint_as_float(qw[k] & 0xffff0000u);
            }
        }
    }
}

template <int KIND, int NT, bool VEC>
__device__ __forceinline__ void matvec_float_body(const u8* __restrict__ w, const float* __restrict__ x,
                                                  float* __restrict__ y, int n_out, int n_in, int ntok, int wpr) {
    __shared__ float red[MVF_WARPS][NT];
    constexpr int ES = KIND == 0 ? 4 : 2;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * (MVF_WARPS / wpr) + warp / wpr;
    const int sub = warp % wpr;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    if (row < n_out) {
        const u8* wr = w + (size_t)row * n_in * ES;
        int tail = 0;
        if constexpr (VEC) {
            const int n_chunks = n_in >> 3;
#pragma unroll 2
            for (int c = sub * WARP + lane; c < n_chunks; c += WARP * wpr) {
                float v[8];
                fchunk<KIND>(wr, c, v);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t < ntok) {
                        const float4 a = *(const float4*)(x + (size_t)t * n_in + 8 * c);
                        const float4 b = *(const float4*)(x + (size_t)t * n_in + 8 * c + 4);
                        acc[t] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x + v[5] * b.y +
                                  v[6] * b.z + v[7] * b.w;
                    }
                }
            }
            tail = n_chunks << 3;
        }
        for (int i = tail + sub * WARP + lane; i < n_in; i += WARP * wpr) {
            const float v = fval<KIND>(wr, i);
#pragma unroll
            for (int t = 0; t < NT; ++t)
                if (t < ntok) acc[t] += v * x[(size_t)t * n_in + i];
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = warp_sum(acc[t]);
    if (wpr == 1) {
        if (row < n_out && lane == 0) {
#pragma unroll
            for (int t = 0; t < NT; ++t)
                if (t < ntok) y[(size_t)t * n_out + row] = acc[t];
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < NT; ++t) red[warp][t] = acc[t];
    }
    __syncthreads();
    if (sub == 0 && lane < ntok && row < n_out) {
        float s = 0.0f;
        for (int k = 0; k < wpr; ++k) s += red[warp + k][lane];
        y[(size_t)lane * n_out + row] = s;
    }
}
