// matvec_common.cu: the generic decode matvec and dequantize bodies shared by matvec_legacy.cu and matvec_k.cu
// (prepended as text after common.cu). A quant type is a struct Q with
//   BS (elements per block), TS (bytes per block), P (parts per block: one thread each), R (runs of 4 elements),
//   HAS_MIN (whether the weights carry an offset),
//   load(blk, part, q[R][4], sc[R], mn[R], xo[R]): one part in registers; element k of run r is
//   w = sc[r] * q[r][k] - mn[r] (q a small integer held exactly in a float), at xo[r] + k of the block
//   (xo[r] % 4 == 0, so the activations are read as float4).
// The dot product is taken in q space, sum_k q x, and scaled once per run: acc += sc * sum(q x) - mn * sum(x).

#define MV_WARPS 8  // warps per CTA of the matvec kernels (256 threads)

// small unsigned integer v (< 2^23) -> float 2^23 + v; subtract (2^23 + offset) to get v - offset exactly.
// Two cheap integer/float ops instead of the quarter-rate int -> float conversion.
__device__ __forceinline__ float magic(u32 v) { return __int_as_float(0x4B000000u | v); }
// the same for byte k of a word whose bytes are each < 256 (one PRMT)
__device__ __forceinline__ float magic_byte(u32 w, int k) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540u + k));
}
#define MAGIC 8388608.0f

// kvalues_iq4nl (ggml-common.h) + 128, all in 0..255 so magic() applies: the value of nibble n, minus (MAGIC + 128)
__device__ __forceinline__ u32 iq4nl_u(u32 n) {
    // 1,24,45,63 | 79,93,106,118 | 129,141,153,166 | 181,197,217,241
    const u32 lo = __byte_perm(0x3F2D1801u, 0x766A5D4Fu, n & 7u);
    const u32 hi = __byte_perm(0xA6998D81u, 0xF1D9C5B5u, n & 7u);
    return ((n & 8u) ? hi : lo) & 255u;
}

// y[t, row] for t < ntok <= NT <= 2, RPW rows per warp: the activations of an item are loaded once (registers)
// and used for RPW rows. `wpr` warps share a row group (split along the row, reduced through shared memory).
template <class Q, int NT, int RPW>
__device__ __forceinline__ void matvec_cached(const u8* __restrict__ w, const float* __restrict__ x,
                                              float* __restrict__ y, int n_out, int n_blocks, int ntok, int wpr) {
    __shared__ float red[MV_WARPS][RPW * NT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (MV_WARPS / wpr) + warp / wpr) * RPW;
    const int sub = warp % wpr;
    const int n_in = n_blocks * Q::BS;
    const size_t row_bytes = (size_t)n_blocks * Q::TS;
    const int nr = min(RPW, n_out - row0);
    float acc[RPW][NT];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[rr][t] = 0.0f;
    if (nr > 0) {
        const int n_items = n_blocks * Q::P;
        const u8* w0 = w + (size_t)row0 * row_bytes;
        for (int i = sub * WARP + lane; i < n_items; i += WARP * wpr) {
            const int b = i / Q::P, p = i % Q::P;
            float q[Q::R][4], sc[Q::R], mn[Q::R];
            int xo[Q::R];
            Q::load(w0 + (size_t)b * Q::TS, p, q, sc, mn, xo);  // row 0 of the group (always there)
            const float* xb = x + b * Q::BS;
            float4 xv[NT][Q::R];
            float sx[NT][Q::R];
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int r = 0; r < Q::R; ++r) {
                    if (t < ntok) {
                        xv[t][r] = *(const float4*)(xb + t * n_in + xo[r]);
                    } else {
                        xv[t][r].x = xv[t][r].y = xv[t][r].z = xv[t][r].w = 0.0f;
                    }
                    sx[t][r] = (xv[t][r].x + xv[t][r].y) + (xv[t][r].z + xv[t][r].w);
                }
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr) {
                if (rr > 0) {
                    // every row is read unconditionally (one past the end reads the group's last row, and its
                    // sum is never written): straight-line code, so ptxas issues every row's loads up front
                    const int rs = rr < nr ? rr : nr - 1;
                    Q::load(w0 + rs * row_bytes + (size_t)b * Q::TS, p, q, sc, mn, xo);
                }
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    float s = 0.0f;
#pragma unroll
                    for (int r = 0; r < Q::R; ++r) {
                        const float d = q[r][0] * xv[t][r].x + q[r][1] * xv[t][r].y + q[r][2] * xv[t][r].z +
                                        q[r][3] * xv[t][r].w;
                        s += sc[r] * d;
                        if constexpr (Q::HAS_MIN) s -= mn[r] * sx[t][r];
                    }
                    acc[rr][t] += s;
                }
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[rr][t] = warp_sum(acc[rr][t]);
    if (wpr == 1) {
        if (lane == 0) {
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr)
#pragma unroll
                for (int t = 0; t < NT; ++t)
                    if (rr < nr && t < ntok) y[(size_t)t * n_out + row0 + rr] = acc[rr][t];
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr)
#pragma unroll
            for (int t = 0; t < NT; ++t) red[warp][rr * NT + t] = acc[rr][t];
    }
    __syncthreads();
    if (sub == 0 && lane < RPW * NT) {
        const int rr = lane / NT, t = lane % NT;
        if (rr < nr && t < ntok) {
            float s = 0.0f;
            for (int k = 0; k < wpr; ++k) s += red[warp + k][lane];
            y[(size_t)t * n_out + row0 + rr] = s;
        }
    }
}

// the same for more tokens (NT 4, 8), one row per warp: the activations are streamed token by token
template <class Q, int NT>
__device__ __forceinline__ void matvec_stream(const u8* __restrict__ w, const float* __restrict__ x,
                                              float* __restrict__ y, int n_out, int n_blocks, int ntok, int wpr) {
    __shared__ float red[MV_WARPS][NT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * (MV_WARPS / wpr) + warp / wpr;
    const int sub = warp % wpr;
    const int n_in = n_blocks * Q::BS;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    if (row < n_out) {
        const u8* wr = w + (size_t)row * n_blocks * Q::TS;
        const int n_items = n_blocks * Q::P;
        for (int i = sub * WARP + lane; i < n_items; i += WARP * wpr) {
            const int b = i / Q::P, p = i % Q::P;
            float q[Q::R][4], sc[Q::R], mn[Q::R];
            int xo[Q::R];
            Q::load(wr + (size_t)b * Q::TS, p, q, sc, mn, xo);
            const float* xb = x + b * Q::BS;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < ntok) {
                    float s = 0.0f;
#pragma unroll
                    for (int r = 0; r < Q::R; ++r) {
                        const float4 v = *(const float4*)(xb + t * n_in + xo[r]);
                        const float d = q[r][0] * v.x + q[r][1] * v.y + q[r][2] * v.z + q[r][3] * v.w;
                        s += sc[r] * d;
                        if constexpr (Q::HAS_MIN) s -= mn[r] * ((v.x + v.y) + (v.z + v.w));
                    }
                    acc[t] += s;
                }
            }
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

// element value of a loaded part: sc q - mn (sc q for a type without an offset)
template <class Q>
__device__ __forceinline__ float qvalue(float sc, float q, float mn) {
    return Q::HAS_MIN ? sc * q - mn : sc * q;
}

// out[r, :] = dequant(W[rows ? rows[r] : r, :]) as fp16 bits (HALF) or float32; one thread per (row, block, part)
template <class Q, bool HALF>
__device__ __forceinline__ void dequant_body(const u8* __restrict__ w, const i32* __restrict__ rows, void* out,
                                             int n_rows, int n_blocks) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned items_per_row = (unsigned)n_blocks * Q::P;
    const unsigned r = i / items_per_row;
    if (r >= (unsigned)n_rows) return;
    const unsigned j = i - r * items_per_row;
    const unsigned b = j / Q::P, p = j % Q::P;
    const size_t src = rows ? (size_t)rows[r] : (size_t)r;
    float q[Q::R][4], sc[Q::R], mn[Q::R];
    int xo[Q::R];
    Q::load(w + (src * n_blocks + b) * Q::TS, p, q, sc, mn, xo);
    const size_t base = ((size_t)r * n_blocks + b) * Q::BS;
    if constexpr (HALF) {  // R is even: runs in pairs, one 16-byte store where a pair is adjacent and aligned
#pragma unroll
        for (int k = 0; k < Q::R; k += 2) {
            uint2 h[2];
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                float v[4];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    v[e] = qvalue<Q>(sc[k + kk], q[k + kk][e], mn[k + kk]);
                h[kk].x = (u32)f2h(v[0]) | ((u32)f2h(v[1]) << 16);
                h[kk].y = (u32)f2h(v[2]) | ((u32)f2h(v[3]) << 16);
            }
            u16* dst = (u16*)out + base + xo[k];
            if (xo[k + 1] == xo[k] + 4 && ((size_t)dst & 15) == 0) {
                *(uint4*)dst = make_uint4(h[0].x, h[0].y, h[1].x, h[1].y);
            } else {
                *(uint2*)dst = h[0];
                *(uint2*)((u16*)out + base + xo[k + 1]) = h[1];
            }
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < Q::R; ++k) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = qvalue<Q>(sc[k], q[k][e], mn[k]);
        *(float4*)((float*)out + base + xo[k]) = make_float4(v[0], v[1], v[2], v[3]);
    }
}

// extern "C" entries per type: matvec_<t>_1r{1,2,4} (one token, RPW rows per warp), matvec_<t>_2 (two tokens,
// 2 rows per warp), matvec_<t>_4 / _8 (streamed), and the two dequantizers (fp16 for GEMM, f32 for get_rows).
#define MV_ARGS                                                                                              \
    const u8 *__restrict__ w, const float *__restrict__ x, float *__restrict__ y, int n_out, int n_blocks,   \
        int ntok, int wpr

// MoE (MUL_MAT_ID) on float activations: grid (CTAs, slots); slot s multiplies expert ids[s] (expert_bytes apart)
// by x row s / x_div into y row s (matvec_q8id's layout in matvec_q8.cu)
#define MVID_ARGS                                                                                            \
    const u8 *__restrict__ w, const i32 *__restrict__ ids, long long expert_bytes, const float *__restrict__ x, \
        int x_div, float *__restrict__ y, int n_out, int n_blocks, int wpr

// built with -DMOE_MMA=1 (kernels_gpu/moe.py), a type's entries are its prefill MoE GEMMs instead (moe_mma.cu):
// a separate build, so that a dense model's first run does not compile them
#if defined(MOE_MMA) && MOE_MMA
#define QUANT_ENTRIES(name, Q) MOE_MMA_ENTRIES(name, Q)
#else
#define QUANT_ENTRIES(name, Q)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) matvec_##name##_1r1(MV_ARGS) {                         \
        matvec_cached<Q, 1, 1>(w, x, y, n_out, n_blocks, ntok, wpr);                                         \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) matvec_##name##_1r2(MV_ARGS) {                         \
        matvec_cached<Q, 1, 2>(w, x, y, n_out, n_blocks, ntok, wpr);                                         \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) matvec_##name##_1r4(MV_ARGS) {                         \
        matvec_cached<Q, 1, 4>(w, x, y, n_out, n_blocks, ntok, wpr);                                         \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) matvec_##name##_2(MV_ARGS) {                           \
        matvec_cached<Q, 2, 2>(w, x, y, n_out, n_blocks, ntok, wpr);                                         \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) matvec_##name##_4(MV_ARGS) {                           \
        matvec_stream<Q, 4>(w, x, y, n_out, n_blocks, ntok, wpr);                                            \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) matvec_##name##_8(MV_ARGS) {                           \
        matvec_stream<Q, 8>(w, x, y, n_out, n_blocks, ntok, wpr);                                            \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) matvec_id_##name##_1r2(MVID_ARGS) {                   \
        const int s = blockIdx.y;                                                                            \
        matvec_cached<Q, 1, 2>(w + (size_t)ids[s] * (size_t)expert_bytes,                                    \
                               x + (size_t)(s / x_div) * n_blocks * Q::BS, y + (size_t)s * n_out, n_out,     \
                               n_blocks, 1, wpr);                                                            \
    }                                                                                                        \
    extern "C" __global__ void dequant_f16_##name(const u8* __restrict__ w, const i32* __restrict__ rows,   \
                                                  u16* out, int n_rows, int n_blocks) {                      \
        dequant_body<Q, true>(w, rows, out, n_rows, n_blocks);                                               \
    }                                                                                                        \
    extern "C" __global__ void dequant_f32_##name(const u8* __restrict__ w, const i32* __restrict__ rows,   \
                                                  float* out, int n_rows, int n_blocks) {                    \
        dequant_body<Q, false>(w, rows, out, n_rows, n_blocks);                                              \
    }
#endif
