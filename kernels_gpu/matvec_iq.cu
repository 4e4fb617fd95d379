// matvec_iq.cu: ggml's codebook super-block types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) for
// matvec_common.cu, after the generated tables of iq_grids.cu (kernels_gpu/iq_tables.py). Every type splits its
// block into P = 8 parts of 32 elements (sub-block ib = p), R = 8 runs of 4 (xo = 32p + 4r). Layouts:
// ggml-common.h; element values as the dequantize_row_iq* loops of ggml-quants.c (and gguf_io/quants_iq.py),
// with q the signed grid value (IQ1: grid +- 1/8) and sc the scale of its 16 elements, so sc * q is ggml's value.

#define IQ_LOAD_ARGS const u8 *b, int p, float (&q)[R][4], float (&sc)[R], float (&mn)[R], int (&xo)[R]

// 8 unsigned grid bytes (little-endian in g) with sign bits sg (bit j set: element j negative) -> two runs of 4
__device__ __forceinline__ void grid8_signed(u64 g, u32 sg, float (&lo)[4], float (&hi)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float a = (float)(u32)((g >> (8 * k)) & 255u), c = (float)(u32)((g >> (32 + 8 * k)) & 255u);
        lo[k] = ((sg >> k) & 1u) ? -a : a;
        hi[k] = ((sg >> (k + 4)) & 1u) ? -c : c;
    }
}

// 4 unsigned grid bytes of g with sign bits sg (bit k: element k negative) -> one run of 4
__device__ __forceinline__ void grid4_signed(u32 g, u32 sg, float (&v)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float a = (float)((g >> (8 * k)) & 255u);
        v[k] = ((sg >> k) & 1u) ? -a : a;
    }
}

// 8 int8 grid bytes (-1, 0, 1) of an iq1s_grid entry plus delta -> two runs of 4
__device__ __forceinline__ void grid8_iq1(u64 g, float delta, float (&lo)[4], float (&hi)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lo[k] = (float)(int)(i8)((g >> (8 * k)) & 255u) + delta;
        hi[k] = (float)(int)(i8)((g >> (32 + 8 * k)) & 255u) + delta;
    }
}

// the runs 2l, 2l + 1 (elements 8l .. 8l + 7 of the part) all get scale s
__device__ __forceinline__ void iq_runs(int p, int l, float s, float (&sc)[8], float (&mn)[8], int (&xo)[8]) {
    sc[2 * l] = sc[2 * l + 1] = s;
    mn[2 * l] = mn[2 * l + 1] = 0.0f;
    xo[2 * l] = 32 * p + 8 * l;
    xo[2 * l + 1] = 32 * p + 8 * l + 4;
}

// byte k (compile-time after unrolling, < 8) of two words
__device__ __forceinline__ u32 byte8(u32 a, u32 c, int k) { return ((k < 4 ? a : c) >> (8 * (k & 3))) & 255u; }

// block_iq2_xxs: d (fp16), qs[32] (u16). Sub-block p: u32 a (4 grid indices, a byte each), u32 s (4 seven-bit
// ksigns indices, the scale in bits 28..31); y = d * (0.5 + scale) * 0.25 * iq2xxs_grid[idx] * sign
struct IQ2_XXS {
    static constexpr int BS = 256, TS = 66, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(IQ_LOAD_ARGS) {
        const float d = ld_f16(b);
        const u32 a = ld_u32_a2(b + 2 + 8 * p), s = ld_u32_a2(b + 6 + 8 * p);
        const float db = d * (0.5f + (float)(s >> 28)) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 sg = ksigns_iq2xs[(s >> (7 * l)) & 127u];
            grid8_signed(iq2xxs_grid[(a >> (8 * l)) & 255u], sg, q[2 * l], q[2 * l + 1]);
            iq_runs(p, l, db, sc, mn, xo);
        }
    }
};

// block_iq2_xs: d (fp16), qs[32] (u16: 9-bit grid index | ksigns index << 9), scales[8] (a nibble per 16 elements)
struct IQ2_XS {
    static constexpr int BS = 256, TS = 74, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(IQ_LOAD_ARGS) {
        const float d = ld_f16(b);
        const u32 a = ld_u32_a2(b + 2 + 8 * p), c = ld_u32_a2(b + 6 + 8 * p);
        const u32 s = b[66 + p];
        const float db0 = d * (0.5f + (float)(s & 15u)) * 0.25f, db1 = d * (0.5f + (float)(s >> 4)) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 v = ((l < 2 ? a : c) >> (16 * (l & 1))) & 0xFFFFu;
            grid8_signed(iq2xs_grid[v & 511u], ksigns_iq2xs[v >> 9], q[2 * l], q[2 * l + 1]);
            iq_runs(p, l, l < 2 ? db0 : db1, sc, mn, xo);
        }
    }
};

// block_iq2_s: d (fp16), qs[32] (grid index low bytes), signs[32], qh[8] (2 high index bits per 8 elements),
// scales[8] (a nibble per 16)
struct IQ2_S {
    static constexpr int BS = 256, TS = 82, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(IQ_LOAD_ARGS) {
        const float d = ld_f16(b);
        const u32 qs = ld_u32_a2(b + 2 + 4 * p), sg = ld_u32_a2(b + 34 + 4 * p);
        const u32 qh = b[66 + p], s = b[74 + p];
        const float db0 = d * (0.5f + (float)(s & 15u)) * 0.25f, db1 = d * (0.5f + (float)(s >> 4)) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 idx = ((qs >> (8 * l)) & 255u) | ((qh << (8 - 2 * l)) & 0x300u);
            grid8_signed(iq2s_grid[idx], (sg >> (8 * l)) & 255u, q[2 * l], q[2 * l + 1]);
            iq_runs(p, l, l < 2 ? db0 : db1, sc, mn, xo);
        }
    }
};

// block_iq3_xxs: d (fp16), qs[64] (grid indices, 4 elements each), then u32 scales_and_signs[8] (4 ksigns indices,
// the scale in bits 28..31); y = d * (0.5 + scale) * 0.5 * iq3xxs_grid[idx] * sign
struct IQ3_XXS {
    static constexpr int BS = 256, TS = 98, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(IQ_LOAD_ARGS) {
        const float d = ld_f16(b);
        const u32 a = ld_u32_a2(b + 2 + 8 * p), c = ld_u32_a2(b + 6 + 8 * p), ss = ld_u32_a2(b + 66 + 4 * p);
        const float db = d * (0.5f + (float)(ss >> 28)) * 0.5f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 sg = ksigns_iq2xs[(ss >> (7 * l)) & 127u];
            grid4_signed(iq3xxs_grid[byte8(a, c, 2 * l)], sg, q[2 * l]);
            grid4_signed(iq3xxs_grid[byte8(a, c, 2 * l + 1)], sg >> 4, q[2 * l + 1]);
            iq_runs(p, l, db, sc, mn, xo);
        }
    }
};

// block_iq3_s: d (fp16), qs[64] (index low bytes), qh[8] (bit k of qh[p]: bit 8 of index k of sub-block p),
// signs[32], scales[4] (a nibble per 32); y = d * (1 + 2 scale) * iq3s_grid[idx] * sign
struct IQ3_S {
    static constexpr int BS = 256, TS = 110, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(IQ_LOAD_ARGS) {
        const float d = ld_f16(b);
        const u32 a = ld_u32_a2(b + 2 + 8 * p), c = ld_u32_a2(b + 6 + 8 * p), sg = ld_u32_a2(b + 74 + 4 * p);
        const u32 qh = b[66 + p];
        const float db = d * (float)(1u + 2u * ((b[106 + p / 2] >> (4 * (p & 1))) & 15u));
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 s8 = (sg >> (8 * l)) & 255u;
            grid4_signed(iq3s_grid[byte8(a, c, 2 * l) | (((qh >> (2 * l)) & 1u) << 8)], s8, q[2 * l]);
            grid4_signed(iq3s_grid[byte8(a, c, 2 * l + 1) | (((qh >> (2 * l + 1)) & 1u) << 8)], s8 >> 4, q[2 * l + 1]);
            iq_runs(p, l, db, sc, mn, xo);
        }
    }
};

// block_iq1_s: d (fp16), qs[32] (index low bytes), qh[8] (u16: 3 high bits per index, the scale in bits 12..14,
// the delta's sign in bit 15); y = d * (2 scale + 1) * (iq1s_grid[idx] +- 1/8)
struct IQ1_S {
    static constexpr int BS = 256, TS = 50, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(IQ_LOAD_ARGS) {
        const float d = ld_f16(b);
        const u32 qs = ld_u32_a2(b + 2 + 4 * p), qh = ld_u16(b + 34 + 2 * p);
        const float dl = d * (float)(2u * ((qh >> 12) & 7u) + 1u);
        const float delta = (qh & 0x8000u) ? -0.125f : 0.125f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 idx = ((qs >> (8 * l)) & 255u) | (((qh >> (3 * l)) & 7u) << 8);
            grid8_iq1(iq1s_grid[idx], delta, q[2 * l], q[2 * l + 1]);
            iq_runs(p, l, dl, sc, mn, xo);
        }
    }
};

// block_iq1_m: qs[32] (index low bytes), qh[16] (a nibble per 8 elements: 3 high index bits, the delta's sign),
// scales[8] (4 u16: a 3-bit scale per 16 elements; the top nibbles of the 4 are the fp16 d)
struct IQ1_M {
    static constexpr int BS = 256, TS = 56, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(IQ_LOAD_ARGS) {
        const u32 s0 = ld_u16(b + 48), s1 = ld_u16(b + 50), s2 = ld_u16(b + 52), s3 = ld_u16(b + 54);
        const float d = h2f((u16)((s0 >> 12) | ((s1 >> 8) & 0xF0u) | ((s2 >> 4) & 0xF00u) | (s3 & 0xF000u)));
        const u32 sw = (p >> 1) == 0 ? s0 : ((p >> 1) == 1 ? s1 : ((p >> 1) == 2 ? s2 : s3));
        const int sh = 6 * (p & 1);
        const float dl0 = d * (float)(2u * ((sw >> sh) & 7u) + 1u);
        const float dl1 = d * (float)(2u * ((sw >> (sh + 3)) & 7u) + 1u);
        const u32 qs = ld_u32_a2(b + 4 * p), qh = ld_u16(b + 32 + 2 * p);
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const u32 h = (qh >> (4 * l)) & 15u;  // nibble l: qh[p*2 + l/2] >> 4 (l % 2)
            grid8_iq1(iq1s_grid[((qs >> (8 * l)) & 255u) | ((h & 7u) << 8)], (h & 8u) ? -0.125f : 0.125f, q[2 * l],
                      q[2 * l + 1]);
            iq_runs(p, l, l < 2 ? dl0 : dl1, sc, mn, xo);
        }
    }
};

QUANT_ENTRIES(iq2_xxs, IQ2_XXS)
QUANT_ENTRIES(iq2_xs, IQ2_XS)
QUANT_ENTRIES(iq2_s, IQ2_S)
QUANT_ENTRIES(iq3_xxs, IQ3_XXS)
QUANT_ENTRIES(iq3_s, IQ3_S)
QUANT_ENTRIES(iq1_s, IQ1_S)
QUANT_ENTRIES(iq1_m, IQ1_M)
