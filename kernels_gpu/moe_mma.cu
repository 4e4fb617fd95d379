// moe_mma.cu: the prefill MoE FFN's grouped GEMMs on the tensor cores (mma.sync m16n8k16, fp16 in, fp32
// accumulation), the quantized expert blocks dequantized tile by tile into shared memory: no fp16 copy of the
// experts in global memory and no padding of the expert groups. Prepended (as text) after matvec_common.cu to the
// modules of the quantized types; QUANT_ENTRIES adds one pair of entries per type Q (see MOE_MMA_ENTRIES).
//
// The rows of a batch's (token, expert) pairs are grouped by expert on the device (moe.cu: moe_group). A tile is
// up to MM_BM consecutive rows of one expert: tiles (n_tiles, 4) int32 = (expert, first row, rows, 0), *n_tiles of
// them. Grid (output column blocks of MM_BN, the most tiles there can be: CTAs past *n_tiles return at once),
// MM_THREADS threads: 8 warps, each 32 rows x 16 columns of the 64 x 64 tile (two CTAs an SM: 16 warps to hide the
// latency of the loads).
// K runs in chunks of MM_CK elements (whole blocks: 256-element blocks, or 8 of 32): the activations' chunk and
// each weight's chunk go to shared memory as fp16, rows padded to MM_LD halves (conflict-free fragment loads).

#define MM_BM 64
#define MM_BN 64
#define MM_CK 256
#define MM_LD (MM_CK + 8)
#define MM_THREADS 256

// d += a (16x16, row major) * b (16x8, column major): fragment layouts of the PTX ISA for m16n8k16 .f16
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// two floats -> fp16 pair bits (a low, b high), round to nearest even: one cvt for both
__device__ __forceinline__ u32 f2h2(float a, float b) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
}

// rows [n0, n0 + MM_BN) of one expert's weight (clamped to n_out - 1: those columns are never stored), K chunk
// [k0, k0 + ck), dequantized to fp16 into ws (MM_BN rows of MM_LD halves); one (row, block, part) per thread
template <class Q>
__device__ __forceinline__ void mm_load_w(const u8* __restrict__ w, size_t row_bytes, int n0, int n_out, int k0,
                                          int ck, u16* __restrict__ ws) {
    const int bpc = ck / Q::BS;
    const int per_row = bpc * Q::P;
    for (int it = threadIdx.x; it < MM_BN * per_row; it += MM_THREADS) {
        const int r = it / per_row, j = it - r * per_row;
        const int b = j / Q::P, p = j - b * Q::P;
        const int n = min(n0 + r, n_out - 1);
        float q[Q::R][4], sc[Q::R], mn[Q::R];
        int xo[Q::R];
        Q::load(w + (size_t)n * row_bytes + (size_t)(k0 / Q::BS + b) * Q::TS, p, q, sc, mn, xo);
        u16* dst = ws + r * MM_LD + b * Q::BS;
#pragma unroll
        for (int k = 0; k < Q::R; ++k) {
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = qvalue<Q>(sc[k], q[k][e], mn[k]);
            *(uint2*)(dst + xo[k]) = make_uint2(f2h2(v[0], v[1]), f2h2(v[2], v[3]));
        }
    }
}

// the activations' chunk: MM_BM rows (row i of the tile: x row src[row0 + i] in float32 when src, else fp16 row
// row0 + i of x16), zeros past `rows`
__device__ __forceinline__ void mm_load_x(const float* __restrict__ x, const i32* __restrict__ src,
                                          const u16* __restrict__ x16, int row0, int rows, int K, int k0, int ck,
                                          u16* __restrict__ xs) {
    if (src) {
        const int vpr = ck / 4;  // float4 a row
        for (int i = threadIdx.x; i < MM_BM * vpr; i += MM_THREADS) {
            const int r = i / vpr, c = (i - r * vpr) * 4;
            uint2 h = make_uint2(0u, 0u);
            if (r < rows) {
                const float4 v = *(const float4*)(x + (size_t)src[row0 + r] * K + k0 + c);
                h = make_uint2(f2h2(v.x, v.y), f2h2(v.z, v.w));
            }
            *(uint2*)(xs + r * MM_LD + c) = h;
        }
        return;
    }
    const int vpr = ck / 8;  // uint4 (8 halves) a row
    for (int i = threadIdx.x; i < MM_BM * vpr; i += MM_THREADS) {
        const int r = i / vpr, c = (i - r * vpr) * 8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows) v = *(const uint4*)(x16 + (size_t)(row0 + r) * K + k0 + c);
        *(uint4*)(xs + r * MM_LD + c) = v;
    }
}

#define MM_NI 2  // n8 tiles a warp: 16 columns
// this warp's rows and columns in the tile: 2 x 4 warps of 32 x 16
#define MM_WARP_TILE                                                                 \
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3; \
    const int wm = (warp >> 2) * 32, wn = (warp & 3) * (8 * MM_NI);

// acc[i] += xs (this warp's 32 rows) * ws_i^T (its 16 columns) over a chunk of ck elements, for NW weights
template <int NW>
__device__ __forceinline__ void mm_chunk(const u16* __restrict__ xs, const u16* __restrict__ ws, int ck,
                                         float (&acc)[NW][2][MM_NI][4]) {
    MM_WARP_TILE
    for (int kk = 0; kk < ck; kk += 16) {
        u32 a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
            const u16* pa = xs + (wm + mi * 16 + g) * MM_LD + kk + 2 * t;
            a[mi][0] = *(const u32*)pa;
            a[mi][1] = *(const u32*)(pa + 8 * MM_LD);
            a[mi][2] = *(const u32*)(pa + 8);
            a[mi][3] = *(const u32*)(pa + 8 * MM_LD + 8);
        }
#pragma unroll
        for (int i = 0; i < NW; ++i)
#pragma unroll
            for (int ni = 0; ni < MM_NI; ++ni) {
                const u16* pb = ws + i * MM_BN * MM_LD + (wn + ni * 8 + g) * MM_LD + kk + 2 * t;
                const u32 b[2] = {*(const u32*)pb, *(const u32*)(pb + 8)};
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) mma_16816(acc[i][mi][ni], a[mi], b);
            }
    }
}

// The tile of expert e, rows [row0, row0 + rows) and columns [n0, n0 + MM_BN): acc[i] = X W_i[e]^T (fp32).
// NW = 2: gate and up of one type (w0, w1); X from float32 rows of x gathered by src. NW = 1: x16 rows as they are.
template <class Q, int NW>
__device__ __forceinline__ void mm_tile(const u8* __restrict__ w0, const u8* __restrict__ w1, long long expert_bytes,
                                        int e, int row0, int rows, int n0, int n_out, int K, const float* __restrict__ x,
                                        const i32* __restrict__ src, const u16* __restrict__ x16,
                                        float (&acc)[NW][2][MM_NI][4]) {
    extern __shared__ __align__(16) u16 mm_smem[];
    u16* xs = mm_smem;
    u16* ws = mm_smem + MM_BM * MM_LD;
    const size_t row_bytes = (size_t)(K / Q::BS) * Q::TS;
    const u8* we[2] = {w0 + (size_t)e * (size_t)expert_bytes, w1 + (size_t)e * (size_t)expert_bytes};
#pragma unroll
    for (int i = 0; i < NW; ++i)
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
            for (int ni = 0; ni < MM_NI; ++ni)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[i][mi][ni][c] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += MM_CK) {
        const int ck = min(MM_CK, K - k0);
        mm_load_x(x, src, x16, row0, rows, K, k0, ck, xs);
#pragma unroll
        for (int i = 0; i < NW; ++i) mm_load_w<Q>(we[i], row_bytes, n0, n_out, k0, ck, ws + i * MM_BN * MM_LD);
        __syncthreads();
        mm_chunk<NW>(xs, ws, ck, acc);
        __syncthreads();
    }
}

// f(mi, ni, hh, r, c) for each pair of accumulators of this warp: acc[.][mi][ni][2 hh], [2 hh + 1] hold tile row r,
// columns c and c + 1 (c even)
template <class F>
__device__ __forceinline__ void mm_each_pair(F f) {
    MM_WARP_TILE
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < MM_NI; ++ni)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) f(mi, ni, hh, wm + mi * 16 + g + 8 * hh, wn + ni * 8 + 2 * t);
}

// this CTA's tile: expert e, rows [row0, row0 + rows), columns from n0
#define MM_THIS_TILE                                                                                        \
    const int e = tiles[4 * blockIdx.y], row0 = tiles[4 * blockIdx.y + 1], rows = tiles[4 * blockIdx.y + 2]; \
    const int n0 = blockIdx.x * MM_BN;

// Gate and up with the GLU: a16[row, n] = glu_act(gate + bias_g, up + bias_u, act) in fp16, for the rows of every
// tile (x: the normed tokens (n_tok, K) f32; src: each row's token). Biases (n_expert, n_out) f32, or null.
template <class Q>
__device__ __forceinline__ void moe_mma_glu_body(const u8* __restrict__ wg, const u8* __restrict__ wu,
                                                 long long expert_bytes, const i32* __restrict__ tiles,
                                                 const i32* __restrict__ n_tiles, const float* __restrict__ x,
                                                 const i32* __restrict__ src, int K, int n_out,
                                                 const float* __restrict__ bg, const float* __restrict__ bu, int act,
                                                 u16* __restrict__ a16) {
    if ((int)blockIdx.y >= *n_tiles) return;  // the grid is sized for the most tiles there can be
    MM_THIS_TILE
    float acc[2][2][MM_NI][4];
    mm_tile<Q, 2>(wg, wu, expert_bytes, e, row0, rows, n0, n_out, K, x, src, nullptr, acc);
    mm_each_pair([&](int mi, int ni, int hh, int r, int c0) {
        const int n = n0 + c0;
        if (r >= rows || n >= n_out) return;
        u32 out = 0;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            if (n + c >= n_out) continue;
            const float gv = acc[0][mi][ni][2 * hh + c] + (bg ? bg[(size_t)e * n_out + n + c] : 0.0f);
            const float uv = acc[1][mi][ni][2 * hh + c] + (bu ? bu[(size_t)e * n_out + n + c] : 0.0f);
            out |= (u32)f2h(glu_act(gv, uv, act)) << (16 * c);
        }
        u16* dst = a16 + (size_t)(row0 + r) * n_out + n;
        if (n + 1 < n_out) {
            *(u32*)dst = out;  // n even, n_out even: 4-byte aligned
        } else {
            *dst = (u16)out;
        }
    });
}

// One projection: y[row, n] = x16[row] . W[e][n] (+ bias[e][n]) in float32, for the rows of every tile
template <class Q>
__device__ __forceinline__ void moe_mma_body(const u8* __restrict__ w, long long expert_bytes,
                                             const i32* __restrict__ tiles, const i32* __restrict__ n_tiles,
                                             const u16* __restrict__ x16, int K,
                                             int n_out, const float* __restrict__ bias, float* __restrict__ y) {
    if ((int)blockIdx.y >= *n_tiles) return;  // the grid is sized for the most tiles there can be
    MM_THIS_TILE
    float acc[1][2][MM_NI][4];
    mm_tile<Q, 1>(w, w, expert_bytes, e, row0, rows, n0, n_out, K, nullptr, nullptr, x16, acc);
    mm_each_pair([&](int mi, int ni, int hh, int r, int c0) {
        const int n = n0 + c0;
        if (r >= rows) return;
#pragma unroll
        for (int c = 0; c < 2; ++c)
            if (n + c < n_out)
                y[(size_t)(row0 + r) * n_out + n + c] =
                    acc[0][mi][ni][2 * hh + c] + (bias ? bias[(size_t)e * n_out + n + c] : 0.0f);
    });
}

#define MOE_MMA_ENTRIES(name, Q)                                                                             \
    extern "C" __global__ void __launch_bounds__(MM_THREADS, 2) moe_mma_glu_##name(                             \
        const u8* __restrict__ wg, const u8* __restrict__ wu, long long expert_bytes,                        \
        const i32* __restrict__ tiles, const i32* __restrict__ n_tiles, const float* __restrict__ x,         \
        const i32* __restrict__ src, int K, int n_out, const float* __restrict__ bg,                        \
        const float* __restrict__ bu, int act, u16* __restrict__ a16) {                                      \
        moe_mma_glu_body<Q>(wg, wu, expert_bytes, tiles, n_tiles, x, src, K, n_out, bg, bu, act, a16);     \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(MM_THREADS, 2) moe_mma_##name(                                 \
        const u8* __restrict__ w, long long expert_bytes, const i32* __restrict__ tiles,                    \
        const i32* __restrict__ n_tiles, const u16* __restrict__ x16, int K, int n_out,                     \
        const float* __restrict__ bias, float* __restrict__ y) {                                             \
        moe_mma_body<Q>(w, expert_bytes, tiles, n_tiles, x16, K, n_out, bias, y);                            \
    }
