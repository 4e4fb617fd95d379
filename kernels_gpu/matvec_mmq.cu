// matvec_mmq.cu (after matvec_q8.cu): y = x W^T for 2-64 tokens of q8 activations and block_q4_K rows on the tensor
// cores (one group of 8 token columns, or 2, 4, 8 of them: mmq_q4_k_body<NG>). One mma.sync m16n8k32 (int8 in,
// int32 out) gives one 32-element sub-block's integer sums for 16 rows x 8 tokens; they are scaled in float32 per
// row (the block's d and dmin, the sub-block's 6-bit scale and min) and per token (the q8 block's d and sum), as
// the dp4a kernels scale them. A warp owns 16 rows and `wpr` warps share their
// blocks (a row tile's sums meet in shared memory). Each lane reads 8 bytes of qs a row and part (whole 32-byte
// sectors a warp load) and 8 activation bytes a token and sub-block, from the activations repacked token-major
// within each q8 block (q8_mma_pack, below): a warp's activation words and scales are one or two cache lines, and
// they serve 16 rows at once. (Reading quantize_q8_1's layout in place, 8 lines a warp load, the kernel was L1-bound:
// 1481 against 1712 GB/s, 14336x4096, 8 tokens.)
// The k order inside a sub-block is permuted the same way for both operands (lane t's A words hold elements
// 8t..8t+3 and 8t+4..8t+7, and so do its B words), which leaves every sum unchanged.
// Columns past ntok read what the packed buffer holds there (each column of a product depends on its own B column
// alone) and are never stored; rows past n_out re-read the last row and are never stored.

#ifndef MMQ_WARPS
#define MMQ_WARPS 8  // warps per CTA (256 threads)
#endif

// c += a (16x32 int8, row major) * b (32x8 int8, column major), PTX's fragment layouts for m16n8k32 .s8:
// a[0] row g, k 4t..4t+3; a[1] row g + 8, same k; a[2] row g, k 16 + 4t..; a[3] row g + 8, k 16 + 4t..;
// b[0] k 4t..4t+3 of column g; b[1] k 16 + 4t..; c[0], c[1] row g, columns 2t, 2t + 1; c[2], c[3] row g + 8
__device__ __forceinline__ void mma_s8_16832(int (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ uint2 ldw64(const u8* p) {  // weights stream once: read-only, not kept in L1
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// One row's block_q4_K header (d | dmin << 16, scales[0..3], [4..7], [8..11]) as floats a sub-block needs:
// get_scale_min_k4's 6-bit scales and mins of sub-blocks 0..3 (words lo) and 4..7 (words hi), bytes j % 4.
struct Q4KHead {
    u32 sc_lo, sc_hi, m_lo, m_hi;
    float d, dmin;
};
__device__ __forceinline__ Q4KHead q4k_head(const uint4& h) {
    const u32 s0 = h.y, s1 = h.z, s2 = h.w;
    return Q4KHead{s0 & 0x3F3F3F3Fu, (s2 & 0x0F0F0F0Fu) | ((s0 >> 2) & 0x30303030u), s1 & 0x3F3F3F3Fu,
                   ((s2 >> 4) & 0x0F0F0F0Fu) | ((s1 >> 2) & 0x30303030u), h2f((u16)(h.x & 0xFFFFu)),
                   h2f((u16)(h.x >> 16))};
}
__device__ __forceinline__ float byte_f(u32 w, int j) { return (float)((w >> (8 * (j & 3))) & 255u); }

// the end of a tensor-core kernel: a row tile's wpr warps add up in `red` ([MMQ_WARPS][4 NG RT][WARP] floats of
// dynamic shared memory, free by now; every thread of the CTA calls this, wpr is the same for all), then the first
// stores its rows' sums
template <int NG, int RT>
__device__ __forceinline__ void mmq_store(float (&acc)[RT][NG][4], float* red, int warp, int lane, int sub, int wpr,
                                          int row0, int n_out, int ntok, float* __restrict__ y) {
    constexpr int V = 4 * NG * RT;
    if (wpr > 1) {
        __syncthreads();  // the memory may have served the kernel before (staged weights)
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int q = 0; q < NG; ++q)
#pragma unroll
                for (int i = 0; i < 4; ++i) red[(warp * V + 4 * (NG * r + q) + i) * WARP + lane] = acc[r][q][i];
        __syncthreads();
        if (sub != 0) return;
        for (int k = 1; k < wpr; ++k)
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int q = 0; q < NG; ++q)
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        acc[r][q][i] += red[((warp + k) * V + 4 * (NG * r + q) + i) * WARP + lane];
    }
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        const int ra = row0 + 16 * r + g, rb = ra + 8;
#pragma unroll
        for (int q = 0; q < NG; ++q) {
            const int ta = 8 * q + 2 * t, tb = ta + 1;
            if (ra < n_out && ta < ntok) y[(size_t)ta * n_out + ra] = acc[r][q][0];
            if (ra < n_out && tb < ntok) y[(size_t)tb * n_out + ra] = acc[r][q][1];
            if (rb < n_out && ta < ntok) y[(size_t)ta * n_out + rb] = acc[r][q][2];
            if (rb < n_out && tb < ntok) y[(size_t)tb * n_out + rb] = acc[r][q][3];
        }
    }
}

// pq, pm: the activations as q8_mma_pack lays them out for T = 8 NG token columns ((n_in / 32, T, 32) int8;
// (n_in / 32, T) float2 (d, d * sum)). NG column groups of 8 tokens: a warp's weight fragments (its 16 rows of a
// sub-block) are loaded and unpacked once and serve every group, one mma each (NG = 1: 2-8 tokens; NG = 2..8: up to
// 64 tokens, a prompt chunk beside decoding sequences). RT row tiles of 16 a warp: each activation fragment a warp
// loads serves RT tiles (at 64 tokens the activations' traffic, not the weights', sets the time).
template <int NG, int RT>
__device__ __forceinline__ void mmq_q4_k_body(const u8* __restrict__ w, const i8* __restrict__ pq,
                                              const float4* __restrict__ pm, float* __restrict__ y, int n_out,
                                              int n_blocks, int ntok, int wpr, int cta) {
    constexpr int T = 8 * NG;
    extern __shared__ __align__(16) u8 mmq_smem[];  // the row tile's sums (wpr > 1): mmq_store's `red`
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = (cta * (MMQ_WARPS / wpr) + warp / wpr) * 16 * RT;  // cta: this CTA's index within the matrix
    const int sub = warp % wpr;
    const size_t row_bytes = (size_t)n_blocks * 144;
    // tile r, group q: (row g, token 8q + 2t), (g, 8q + 2t + 1), (g + 8, 8q + 2t), (g + 8, 8q + 2t + 1)
    float acc[RT][NG][4];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int q = 0; q < NG; ++q) acc[r][q][0] = acc[r][q][1] = acc[r][q][2] = acc[r][q][3] = 0.0f;
    if (row0 < n_out) {
        const u8* wa[RT];
        const u8* wb[RT];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            wa[r] = w + (size_t)min(row0 + 16 * r + g, n_out - 1) * row_bytes;
            wb[r] = w + (size_t)min(row0 + 16 * r + g + 8, n_out - 1) * row_bytes;
        }
        const i8* xg = pq + 32 * g + 8 * t;  // B: token 8q + g's bytes 8t..8t + 7 of q8 block k at xg + 32 (T k + 8 q)
        const float4* ms = pm + t;          // (d, d * sum) of tokens 8q + 2t, + 1 of q8 block k at ms[T / 2 k + 4 q]
        for (int b = sub; b < n_blocks; b += wpr) {
            uint2 qa[RT][4], qb[RT][4];
            Q4KHead ha[RT], hb[RT];
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                const u8* ba = wa[r] + (size_t)b * 144;
                const u8* bb = wb[r] + (size_t)b * 144;
                const uint4 hwa = ldw128(ba), hwb = ldw128(bb);
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    qa[r][p] = ldw64(ba + 16 + 32 * p + 8 * t);
                    qb[r][p] = ldw64(bb + 16 + 32 * p + 8 * t);
                }
                ha[r] = q4k_head(hwa);
                hb[r] = q4k_head(hwb);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {  // sub-block j: the low (j even) or high nibbles of part j / 2
                const int p = j >> 1, sh = 4 * (j & 1);
                const size_t kb = (size_t)(8 * b + j);
                u32 a[RT][4];  // each tile's fragment and scales of sub-block j, unpacked once for every group
                float sca[RT], ma[RT], scb[RT], mb[RT];
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    a[r][0] = (qa[r][p].x >> sh) & 0x0F0F0F0Fu;
                    a[r][1] = (qb[r][p].x >> sh) & 0x0F0F0F0Fu;
                    a[r][2] = (qa[r][p].y >> sh) & 0x0F0F0F0Fu;
                    a[r][3] = (qb[r][p].y >> sh) & 0x0F0F0F0Fu;
                    sca[r] = byte_f(j < 4 ? ha[r].sc_lo : ha[r].sc_hi, j);
                    ma[r] = byte_f(j < 4 ? ha[r].m_lo : ha[r].m_hi, j);
                    scb[r] = byte_f(j < 4 ? hb[r].sc_lo : hb[r].sc_hi, j);
                    mb[r] = byte_f(j < 4 ? hb[r].m_lo : hb[r].m_hi, j);
                }
#pragma unroll
                for (int q = 0; q < NG; ++q) {
                    const uint2 xv = __ldg((const uint2*)(xg + (kb * T + 8 * q) * 32));
                    const u32 bx[2] = {xv.x, xv.y};
                    const float4 v = __ldg(ms + kb * (T / 2) + 4 * q);  // tokens 8q + 2t, + 1: d and d * sum
                    const float d0 = v.x, s0 = v.y, d1 = v.z, s1 = v.w;
#pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        int c[4] = {0, 0, 0, 0};
                        mma_s8_16832(c, a[r], bx);
                        acc[r][q][0] += ha[r].d * (sca[r] * d0 * (float)c[0]) - ha[r].dmin * (ma[r] * s0);
                        acc[r][q][1] += ha[r].d * (sca[r] * d1 * (float)c[1]) - ha[r].dmin * (ma[r] * s1);
                        acc[r][q][2] += hb[r].d * (scb[r] * d0 * (float)c[2]) - hb[r].dmin * (mb[r] * s0);
                        acc[r][q][3] += hb[r].d * (scb[r] * d1 * (float)c[3]) - hb[r].dmin * (mb[r] * s1);
                    }
                }
            }
        }
    }
    mmq_store<NG, RT>(acc, (float*)mmq_smem, warp, lane, sub, wpr, row0, n_out, ntok, y);
}

#ifndef MMQ_MINB
// CTAs of 256 threads an SM must hold of the one-group, one-tile entries (2-8 tokens): __launch_bounds__' cap of
// 64 registers at 4 (0: no cap; 1 differs from none, ptxas then takes more). 4 against none: Q4_K 14336x4096
// 19.7 against 20.2 us, 4096x4096 9.0 against 9.8, 4096x14336 22.3 against 24.9, Q6_K 128256x4096 225.5 against
// 230.4 at 8 tokens; 5 and 6 spill and lose (H200, scripts/gpu_mmq_occupancy.py)
#define MMQ_MINB 4
#endif

// matvec_mmq_<type>[_g<NG>][_t2]: NG groups of 8 token columns, RT = 2 row tiles a warp where named
#define MMQ_ENTRY(NAME, BODY, NG, RT, MINB)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME(const u8* __restrict__ w,                        \
                                                               const i8* __restrict__ pq,                         \
                                                               const float4* __restrict__ pm,                     \
                                                               float* __restrict__ y, int n_out, int n_blocks,    \
                                                               int ntok, int wpr) {                               \
        BODY<NG, RT>(w, pq, pm, y, n_out, n_blocks, ntok, wpr, blockIdx.x);                                        \
    }
// every entry a type has: 1 (2-8 tokens), 2, 4, 8 column groups, each with 1 or 2 row tiles a warp (matmul.mmq_rt)
#define MMQ_ENTRIES(TYPE, BODY)                                                                                    \
    MMQ_ENTRY(matvec_mmq_##TYPE, BODY, 1, 1, MMQ_MINB)                                                            \
    MMQ_ENTRY(matvec_mmq_##TYPE##_t2, BODY, 1, 2, 0)                                                              \
    MMQ_ENTRY(matvec_mmq_##TYPE##_g2, BODY, 2, 1, 0)                                                              \
    MMQ_ENTRY(matvec_mmq_##TYPE##_g4, BODY, 4, 1, 0)                                                              \
    MMQ_ENTRY(matvec_mmq_##TYPE##_g8, BODY, 8, 1, 0)                                                              \
    MMQ_ENTRY(matvec_mmq_##TYPE##_g2_t2, BODY, 2, 2, 0)                                                           \
    MMQ_ENTRY(matvec_mmq_##TYPE##_g4_t2, BODY, 4, 2, 0)                                                           \
    MMQ_ENTRY(matvec_mmq_##TYPE##_g8_t2, BODY, 8, 2, 0)
MMQ_ENTRIES(q4_k, mmq_q4_k_body)

// Up to three Q4_K matrices of one n_in times the same 2-8 tokens in one launch (q, k, v; gate, up): CTAs [0, c1)
// compute the first, [c1, c2) the second, [c2, grid) the third, each as matvec_mmq_q4_k's grid of that matrix alone
// would (the same sums, bit for bit). One launch fills the SMs where the small matrices (k and v: 64 CTAs each)
// alone would leave most of them idle, and a layer's products pay one launch's ramp instead of three.
extern "C" __global__ void __launch_bounds__(256, MMQ_MINB) matvec_mmq_q4_k_m(
    const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2, float* y0, float* y1, float* y2,
    int n0, int n1, int n2, int c1, int c2, const i8* __restrict__ pq, const float4* __restrict__ pm, int n_blocks,
    int ntok, int wpr) {
    const int b = blockIdx.x;
    const int m = b < c1 ? 0 : b < c2 ? 1 : 2;
    mmq_q4_k_body<1, 1>(m == 0 ? w0 : m == 1 ? w1 : w2, pq, pm, m == 0 ? y0 : m == 1 ? y1 : y2,
                        m == 0 ? n0 : m == 1 ? n1 : n2, n_blocks, ntok, wpr, b - (m == 0 ? 0 : m == 1 ? c1 : c2));
}

// quantize_q8_1's activations of ntok <= T tokens (xq (ntok, n), xm (ntok, n / 32, 4)) in matvec_mmq's layout for
// T token columns (T = 8 NG): pq (n / 32, T, 32) int8 (token-major within a q8 block) and pm (n / 32, T, 2) float32 =
// (d, d * (sum lo + sum hi)), the product matvec_q8t's kernels form. Tokens ntok..T - 1 are left as they are (their
// sums are never stored). One thread a 4-byte word: i < ntok * n / 4.
extern "C" __global__ void __launch_bounds__(256) q8_mma_pack(const i8* __restrict__ xq, const float4* __restrict__ xm,
                                                             i8* __restrict__ pq, float2* __restrict__ pm, int n,
                                                             int ntok, int T) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ntok * (n / 4)) return;
    const int tok = i / (n / 4), e = 4 * (i % (n / 4)), blk = e / 32;
    *(u32*)(pq + ((size_t)blk * T + tok) * 32 + e % 32) = *(const u32*)(xq + (size_t)tok * n + e);
    if (e % 32 == 0) {
        const float4 m = xm[(size_t)tok * (n / 32) + blk];
        pm[(size_t)blk * T + tok] = make_float2(m.x, m.x * (m.y + m.z));
    }
}

// quantize_q8_1 and q8_mma_pack in one pass, the same bytes: x (ntok, n) float32 -> pq (n / 32, T, 32) int8 and
// pm (n / 32, T, 2) float32 (d, d * (sum lo + sum hi)), each block's q and sums formed as q8_block_store forms them.
// For an activation that only tensor-core products read (no xq, xm written). One thread a value (n % 32 == 0: a
// warp is one block, in or out as a whole).
extern "C" __global__ void __launch_bounds__(256) quantize_q8_mma(const float* __restrict__ x, i8* __restrict__ pq,
                                                                 float2* __restrict__ pm, int n, int ntok, int T) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ntok * n) return;
    const int tok = i / n, e = i - tok * n, blk = e >> 5;
    const float v = x[i];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f;
    const int q = amax == 0.0f ? 0 : __float2int_rn(v / d);
    pq[((size_t)blk * T + tok) * 32 + (e & 31)] = (i8)q;
    float s = (float)q;  // exact: |sum| <= 16 * 127
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const float s_hi = __shfl_sync(0xffffffffu, s, 16);
    if ((threadIdx.x & 31) == 0) pm[(size_t)blk * T + tok] = make_float2(d, d * (s + s_hi));
}
