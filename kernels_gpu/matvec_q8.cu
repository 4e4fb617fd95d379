// matvec_q8.cu: one-token decode matvec y = W x on integer dot products. The activations are first quantized to
// 8 bits per 32-element block (quantize_q8_1, a q8_1-style layout of our own: int8 qs and one float4 per block),
// then every weight block is dotted with them by dp4a (4 int8 products a instruction) and scaled once per
// sub-block. The float kernels of matvec_common.cu spend ~4 ALU instructions per weight element, which caps a
// 4.5-bit type near the ALU rate; dp4a needs ~1 per 4 elements, so the loads (16-byte, many in flight) set the pace.

#ifndef MV_WARPS
#define MV_WARPS 8  // warps per CTA (256 threads), as matvec_common.cu
#endif

// xm[block] = (d, sum q[0..15], sum q[16..31], 0): d = amax / 127, q = rint(x / d) (0 where the block is all 0)
extern "C" __global__ void __launch_bounds__(256) quantize_q8_1(const float* __restrict__ x, i8* __restrict__ xq,
                                                               float4* __restrict__ xm, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;  // n % 32 == 0: a warp is one block, in or out as a whole
    if (i >= n) return;
    q8_block_store(x[i], xq, xm, i);
}

__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {  // c + sum of the 4 signed byte products
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
// weights stream once: read-only path, not kept in L1 (which holds the activations)
__device__ __forceinline__ uint4 ldw128(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldw32(const u8* p) {
    u32 v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ldx128(const i8* p) { return __ldg((const uint4*)p); }
__device__ __forceinline__ u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// 16 bytes at a 2-byte aligned address a, as 5 aligned words from a & ~3 (the caller guarantees a + 20 is inside
// the block); shifted into place by fix16
struct U16B {
    u32 w[5];
};
__device__ __forceinline__ U16B ld16_a2(const u8* a) {
    const u8* a4 = (const u8*)((size_t)a & ~(size_t)3);
    U16B r;
#pragma unroll
    for (int i = 0; i < 5; ++i) r.w[i] = ldw32(a4 + 4 * i);
    return r;
}
__device__ __forceinline__ u32 fix16(const U16B& r, int i, u32 sh) { return __funnelshift_r(r.w[i], r.w[i + 1], sh); }

// block_q4_K: d, dmin (fp16), scales[12], qs[128]. Part p (of 4) holds qs[32p .. 32p+31]: low nibbles are
// sub-block 2p (elements 64p + l), high nibbles sub-block 2p + 1 (64p + 32 + l): whole q8 blocks 8b + 2p, 2p + 1.
struct Q4K8 {
    static constexpr int BS = 256, TS = 144, P = 4;
    struct W {
        uint4 h, q0, q1;  // header (d | dmin << 16, scales[0..3], [4..7], [8..11]); 32 bytes of qs
    };
    struct X {
        uint4 a0, a1, b0, b1;
        float4 ma, mb;
    };
    __device__ static __forceinline__ W load(const u8* b, int p) {
        W w;
        w.h = ldw128(b);
        w.q0 = ldw128(b + 16 + 32 * p);
        w.q1 = ldw128(b + 32 + 32 * p);
        return w;
    }
    __device__ static __forceinline__ X loadx(const i8* xq, const float4* xm, int b, int p) {
        X x;
        const i8* xb = xq + b * BS + 64 * p;
        x.a0 = ldx128(xb);
        x.a1 = ldx128(xb + 16);
        x.b0 = ldx128(xb + 32);
        x.b1 = ldx128(xb + 48);
        x.ma = xm[b * 8 + 2 * p];
        x.mb = xm[b * 8 + 2 * p + 1];
        return x;
    }
    __device__ static __forceinline__ float dot(const W& w, const X& x, int p) {
        const u32 q[8] = {w.q0.x, w.q0.y, w.q0.z, w.q0.w, w.q1.x, w.q1.y, w.q1.z, w.q1.w};
        const u32 xa[8] = {x.a0.x, x.a0.y, x.a0.z, x.a0.w, x.a1.x, x.a1.y, x.a1.z, x.a1.w};
        const u32 xb[8] = {x.b0.x, x.b0.y, x.b0.z, x.b0.w, x.b1.x, x.b1.y, x.b1.z, x.b1.w};
        int sa = 0, sb = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            sa = dp4a(q[i] & 0x0F0F0F0Fu, xa[i], sa);
            sb = dp4a((q[i] >> 4) & 0x0F0F0F0Fu, xb[i], sb);
        }
        // get_scale_min_k4 for the four sub-blocks of a word at once: 0..3 from the low six bits of
        // scales[0..3] / [4..7]; 4..7 from the nibbles of scales[8..11] and the top two bits of [0..3] / [4..7]
        const u32 s0 = w.h.y, s1 = w.h.z, s2 = w.h.w;
        const u32 scw = p < 2 ? (s0 & 0x3F3F3F3Fu) : ((s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u));
        const u32 mw = p < 2 ? (s1 & 0x3F3F3F3Fu) : (((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u));
        const u32 sh = 16 * (p & 1);
        const float sc_a = (float)((scw >> sh) & 255u), sc_b = (float)((scw >> (sh + 8)) & 255u);
        const float m_a = (float)((mw >> sh) & 255u), m_b = (float)((mw >> (sh + 8)) & 255u);
        const float d = h2f((u16)(w.h.x & 0xFFFFu)), dmin = h2f((u16)(w.h.x >> 16));
        const float dot = sc_a * x.ma.x * (float)sa + sc_b * x.mb.x * (float)sb;
        const float mins = m_a * x.ma.x * (x.ma.y + x.ma.z) + m_b * x.mb.x * (x.mb.y + x.mb.z);
        return d * dot - dmin * mins;
    }
};

// block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16); 2-byte aligned. Part p (of 4): h = p / 2,
// l0 = 16 (p % 2), elements h*128 + 32k + l0 + l (k 0..3, l 0..15), each run half of q8 block 8b + 4h + k.
// q = low4 | high2 << 4 in 0..63 (dp4a as is); the -32 comes off as 32 * (sum of the q8 half).
struct Q6K8 {
    static constexpr int BS = 256, TS = 210, P = 4;
    struct W {
        U16B lo, hi, qh;  // ql[h*64 + l0 ..], ql[h*64 + 32 + l0 ..], qh[h*32 + l0 ..]
        u32 sc01, sc23;   // scales[h*8 + 2k + (0, 1)] as u16 pairs: k = 0, 1 | k = 2, 3
        u16 d;
        u32 sh;
    };
    struct X {
        uint4 q[4];
        float4 m[4];
    };
    __device__ static __forceinline__ W load(const u8* b, int p) {
        const int h = p >> 1, l0 = 16 * (p & 1);
        W w;
        w.lo = ld16_a2(b + h * 64 + l0);
        w.hi = ld16_a2(b + h * 64 + 32 + l0);
        w.qh = ld16_a2(b + 128 + h * 32 + l0);
        w.sc01 = ld_u32_a2(b + 192 + h * 8);
        w.sc23 = ld_u32_a2(b + 192 + h * 8 + 4);
        w.d = ld_u16(b + 208);
        w.sh = 8u * ((u32)(size_t)b & 3u);
        return w;
    }
    __device__ static __forceinline__ X loadx(const i8* xq, const float4* xm, int b, int p) {
        const int h = p >> 1, l0 = 16 * (p & 1);
        X x;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            x.q[k] = ldx128(xq + b * BS + h * 128 + 32 * k + l0);
            x.m[k] = xm[b * 8 + 4 * h + k];
        }
        return x;
    }
    __device__ static __forceinline__ float dot(const W& w, const X& x, int p) {
        int s[4] = {0, 0, 0, 0};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 l = fix16(w.lo, i, w.sh), m = fix16(w.hi, i, w.sh), h = fix16(w.qh, i, w.sh);
            const u32 xk[4] = {word(x.q[0], i), word(x.q[1], i), word(x.q[2], i), word(x.q[3], i)};
            s[0] = dp4a((l & 0x0F0F0F0Fu) | ((h << 4) & 0x30303030u), xk[0], s[0]);
            s[1] = dp4a((m & 0x0F0F0F0Fu) | ((h << 2) & 0x30303030u), xk[1], s[1]);
            s[2] = dp4a(((l >> 4) & 0x0F0F0F0Fu) | (h & 0x30303030u), xk[2], s[2]);
            s[3] = dp4a(((m >> 4) & 0x0F0F0F0Fu) | ((h >> 2) & 0x30303030u), xk[3], s[3]);
        }
        const u32 hs = 8u * (p & 1);  // byte (p % 2) of each u16 pair
        const float sc[4] = {(float)(i8)(w.sc01 >> hs), (float)(i8)(w.sc01 >> (16 + hs)),
                             (float)(i8)(w.sc23 >> hs), (float)(i8)(w.sc23 >> (16 + hs))};
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float half_sum = (p & 1) ? x.m[k].z : x.m[k].y;
            acc += sc[k] * x.m[k].x * ((float)s[k] - 32.0f * half_sum);
        }
        return h2f(w.d) * acc;
    }
};

// The end of a q8 matvec: each lane's partial sums of the warp's RPW rows -> y[row0 .. row0 + nr). A warp that
// has whole rows (wpr 1) stores them itself; else the row group's wpr warps meet in `red` (every thread of the CTA
// calls this: wpr is the same for all).
template <int RPW, int NW>
__device__ __forceinline__ void q8_store_rows(float (&acc)[RPW], float (&red)[NW][RPW], int warp, int lane, int sub,
                                              int wpr, int nr, float* __restrict__ y, int row0) {
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) acc[rr] = warp_sum(acc[rr]);
    if (wpr == 1) {
        if (lane == 0) {
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr)
                if (rr < nr) y[row0 + rr] = acc[rr];
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) red[warp][rr] = acc[rr];
    }
    __syncthreads();
    if (sub == 0 && lane < nr) {
        float s = 0.0f;
        for (int k = 0; k < wpr; ++k) s += red[warp + k][lane];
        y[row0 + lane] = s;
    }
}

// y[row] for RPW rows a warp, `wpr` warps a row group (split along the row, reduced through shared memory).
// Every row's weight loads of an item are issued before its first dp4a (rows past the end re-read the group's
// last row, never written), and the activations of an item are loaded once for the RPW rows.
// `cta` is the CTA's index within this matrix (blockIdx.x, or less in a launch over several matrices).
template <class Q, int RPW>
__device__ __forceinline__ void matvec_q8_body(int cta, const u8* __restrict__ w, const i8* __restrict__ xq,
                                               const float4* __restrict__ xm, float* __restrict__ y, int n_out,
                                               int n_blocks, int wpr) {
    __shared__ float red[MV_WARPS][RPW];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (cta * (MV_WARPS / wpr) + warp / wpr) * RPW;
    const int sub = warp % wpr;
    const size_t row_bytes = (size_t)n_blocks * Q::TS;
    const int nr = min(RPW, n_out - row0);
    float acc[RPW];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) acc[rr] = 0.0f;
    if (nr > 0) {
        const int n_items = n_blocks * Q::P;
        const u8* w0 = w + (size_t)row0 * row_bytes;
        for (int i = sub * WARP + lane; i < n_items; i += WARP * wpr) {
            const int b = i / Q::P, p = i % Q::P;
            typename Q::W wr[RPW];
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr) {
                const int rs = rr < nr ? rr : nr - 1;
                wr[rr] = Q::load(w0 + rs * row_bytes + (size_t)b * Q::TS, p);
            }
            const typename Q::X xv = Q::loadx(xq, xm, b, p);
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr) acc[rr] += Q::dot(wr[rr], xv, p);
        }
    }
    q8_store_rows<RPW>(acc, red, warp, lane, sub, wpr, nr, y, row0);
}

#define MVQ8_ARGS                                                                                            \
    const u8 *__restrict__ w, const i8 *__restrict__ xq, const float4 *__restrict__ xm, float *__restrict__ y, \
        int n_out, int n_blocks, int wpr
#define Q8_ENTRY(name, Q, R)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) matvec_q8_##name##_r##R(MVQ8_ARGS) {                   \
        matvec_q8_body<Q, R>(blockIdx.x, w, xq, xm, y, n_out, n_blocks, wpr);                                \
    }

// One launch over up to three matrices of one type that multiply the same activations (q, k, v; gate, up):
// CTAs [0, c1) work on matrix 0, [c1, c2) on matrix 1, [c2, grid) on matrix 2, each as its own launch would.
// Unused slots repeat a real pointer and get no CTA.
#define MVQ8M_ARGS                                                                                           \
    const u8 *__restrict__ w0, const u8 *__restrict__ w1, const u8 *__restrict__ w2, float *__restrict__ y0, \
        float *__restrict__ y1, float *__restrict__ y2, int n0, int n1, int n2, int c1, int c2,              \
        const i8 *__restrict__ xq, const float4 *__restrict__ xm, int n_blocks, int wpr
struct Q8Pick {
    const u8* w;
    float* y;
    int n_out, cta;
};
__device__ __forceinline__ Q8Pick q8_pick(const u8* w0, const u8* w1, const u8* w2, float* y0, float* y1,
                                          float* y2, int n0, int n1, int n2, int c1, int c2) {
    const int c = blockIdx.x;
    if (c >= c2) return Q8Pick{w2, y2, n2, c - c2};
    if (c >= c1) return Q8Pick{w1, y1, n1, c - c1};
    return Q8Pick{w0, y0, n0, c};
}
#define Q8M_ENTRY(name, Q, R)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) matvec_q8m_##name##_r##R(MVQ8M_ARGS) {                 \
        const Q8Pick m = q8_pick(w0, w1, w2, y0, y1, y2, n0, n1, n2, c1, c2);                                \
        matvec_q8_body<Q, R>(m.cta, m.w, xq, xm, m.y, m.n_out, n_blocks, wpr);                               \
    }
#define Q8_ENTRIES(name, Q)                                                                                  \
    Q8_ENTRY(name, Q, 1) Q8_ENTRY(name, Q, 2) Q8_ENTRY(name, Q, 4) Q8M_ENTRY(name, Q, 1) Q8M_ENTRY(name, Q, 2) \
        Q8M_ENTRY(name, Q, 4)

Q8_ENTRIES(q4_k, Q4K8)
Q8_ENTRIES(q6_k, Q6K8)

// Several tokens (a decode batch of several sequences, a speculative check): y[t, row] for t < ntok <= NT, token t's
// q8 activations at xq + t n_in, xm + t n_in / 32. Each item's weights are loaded once (registers) for RPW rows and
// dotted with every token's activations by dp4a, so the weights stream once for the batch and each token costs
// ~1 instruction per 4 elements (the float kernels of matvec_common.cu cost ~4 per element a token). The sums are
// the one-token kernel's, in the same order. (Unpacking the weights once for all the tokens instead of once a token
// measured slower or within 3% on the H200: more registers, fewer warps.)
template <class Q, int NT, int RPW>
__device__ __forceinline__ void matvec_q8t_body(const u8* __restrict__ w, const i8* __restrict__ xq,
                                                const float4* __restrict__ xm, float* __restrict__ y, int n_out,
                                                int n_blocks, int ntok, int wpr) {
    static_assert(RPW * NT <= WARP, "the row group's sums are finished by one lane each");
    __shared__ float red[MV_WARPS][RPW * NT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (MV_WARPS / wpr) + warp / wpr) * RPW;
    const int sub = warp % wpr;
    const size_t row_bytes = (size_t)n_blocks * Q::TS;
    const size_t n_in = (size_t)n_blocks * Q::BS;
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
            typename Q::W wr[RPW];
#pragma unroll
            for (int rr = 0; rr < RPW; ++rr) {
                const int rs = rr < nr ? rr : nr - 1;
                wr[rr] = Q::load(w0 + rs * row_bytes + (size_t)b * Q::TS, p);
            }
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < ntok) {
                    const typename Q::X xv = Q::loadx(xq + t * n_in, xm + t * (n_in / 32), b, p);
#pragma unroll
                    for (int rr = 0; rr < RPW; ++rr) acc[rr][t] += Q::dot(wr[rr], xv, p);
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
            float sum = 0.0f;
            for (int k = 0; k < wpr; ++k) sum += red[warp + k][lane];
            y[(size_t)t * n_out + row0 + rr] = sum;
        }
    }
}
#define MVQ8T_ARGS                                                                                           \
    const u8 *__restrict__ w, const i8 *__restrict__ xq, const float4 *__restrict__ xm, float *__restrict__ y, \
        int n_out, int n_blocks, int ntok, int wpr
#define Q8T_ENTRY(name, Q, NT, R)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) matvec_q8t_##name##_##NT##_r##R(MVQ8T_ARGS) {          \
        matvec_q8t_body<Q, NT, R>(w, xq, xm, y, n_out, n_blocks, ntok, wpr);                                 \
    }
#define Q8T_ENTRIES(name, Q)                                                                                 \
    Q8T_ENTRY(name, Q, 2, 2) Q8T_ENTRY(name, Q, 2, 4) Q8T_ENTRY(name, Q, 4, 2) Q8T_ENTRY(name, Q, 4, 4)      \
        Q8T_ENTRY(name, Q, 8, 2) Q8T_ENTRY(name, Q, 8, 4)
Q8T_ENTRIES(q4_k, Q4K8)
Q8T_ENTRIES(q6_k, Q6K8)

// MoE (llama.cpp's MUL_MAT_ID) on q8 activations: grid (CTAs a matrix, slots, matrices). Slot s multiplies expert
// ids[s] of matrix z (w0 or w1: (n_expert, n_out, row) blocks, expert_bytes apart) by the q8 activations of row
// s / x_div (x_div = experts a token for gate/up, whose slots share their token's x; 1 for down, each slot its own
// GLU output), into row s of y0 or y1 ((slots, n_out) each). Every selected expert's blocks are read once a slot.
#define MVQ8ID_ARGS                                                                                          \
    const u8 *__restrict__ w0, const u8 *__restrict__ w1, float *__restrict__ y0, float *__restrict__ y1,    \
        const i32 *__restrict__ ids, long long expert_bytes, int n_out, const i8 *__restrict__ xq,           \
        const float4 *__restrict__ xm, int x_div, int n_blocks, int wpr
struct Q8Id {
    const u8* w;
    float* y;
    const i8* xq;
    const float4* xm;
};
template <int BS>
__device__ __forceinline__ Q8Id q8_id_pick(MVQ8ID_ARGS) {
    const int s = blockIdx.y, xr = s / x_div;
    const u8* w = blockIdx.z ? w1 : w0;
    float* y = blockIdx.z ? y1 : y0;
    const size_t n_in = (size_t)n_blocks * BS;
    return Q8Id{w + (size_t)ids[s] * (size_t)expert_bytes, y + (size_t)s * n_out, xq + (size_t)xr * n_in,
                xm + (size_t)xr * (n_in / 32)};
}
#define Q8ID_ENTRY(name, Q, R)                                                                               \
    extern "C" __global__ void __launch_bounds__(256) matvec_q8id_##name##_r##R(MVQ8ID_ARGS) {               \
        const Q8Id m = q8_id_pick<Q::BS>(w0, w1, y0, y1, ids, expert_bytes, n_out, xq, xm, x_div, n_blocks, wpr); \
        matvec_q8_body<Q, R>(blockIdx.x, m.w, m.xq, m.xm, m.y, n_out, n_blocks, wpr);                        \
    }
Q8ID_ENTRY(q4_k, Q4K8, 2)
Q8ID_ENTRY(q6_k, Q6K8, 2)

// Short rows (n_items = n_blocks * P <= 32 items, e.g. an expert's down projection of 768 inputs, 12 items of
// Q4_K): matvec_q8_body would leave 32 - n_items lanes of a warp idle, so here a warp takes 32 / n_items rows a
// pass, lane l item l % n_items of row l / n_items, and RPW passes (their weight loads issued before the first
// dp4a); each row's partial sums are added in item order through shared memory (deterministic).
template <class Q, int RPW>
__device__ __forceinline__ void matvec_q8_short_body(int cta, const u8* __restrict__ w, const i8* __restrict__ xq,
                                                     const float4* __restrict__ xm, float* __restrict__ y,
                                                     int n_out, int n_blocks) {
    __shared__ float part[MV_WARPS][WARP];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_items = n_blocks * Q::P;
    const int per_pass = WARP / n_items;
    const int row0 = (cta * MV_WARPS + warp) * per_pass * RPW;
    const size_t row_bytes = (size_t)n_blocks * Q::TS;
    const int sub = lane / n_items, item = lane % n_items;
    const bool active = sub < per_pass;
    const int b = item / Q::P, p = item % Q::P;
    float acc[RPW];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) acc[rr] = 0.0f;
    if (active && row0 < n_out) {
        typename Q::W wr[RPW];
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) {
            const int row = min(row0 + rr * per_pass + sub, n_out - 1);  // past the end: re-read the last row
            wr[rr] = Q::load(w + (size_t)row * row_bytes + (size_t)b * Q::TS, p);
        }
        const typename Q::X xv = Q::loadx(xq, xm, b, p);
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) acc[rr] = Q::dot(wr[rr], xv, p);
    }
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
        part[warp][lane] = acc[rr];
        __syncwarp();
        const int row = row0 + rr * per_pass + lane;
        if (lane < per_pass && row < n_out) {
            float s = 0.0f;
            for (int j = 0; j < n_items; ++j) s += part[warp][lane * n_items + j];
            y[row] = s;
        }
        __syncwarp();
    }
}
#define Q8ID_SHORT_ENTRY(name, Q, R)                                                                         \
    extern "C" __global__ void __launch_bounds__(256) matvec_q8id_short_##name##_r##R(MVQ8ID_ARGS) {         \
        const Q8Id m = q8_id_pick<Q::BS>(w0, w1, y0, y1, ids, expert_bytes, n_out, xq, xm, x_div, n_blocks, wpr); \
        matvec_q8_short_body<Q, R>(blockIdx.x, m.w, m.xq, m.xm, m.y, n_out, n_blocks);                      \
    }
Q8ID_SHORT_ENTRY(q4_k, Q4K8, 2)
Q8ID_SHORT_ENTRY(q6_k, Q6K8, 2)
