// matvec_k.cu: ggml's 256-element super-block types (Q2_K .. Q6_K, IQ4_XS) for matvec_common.cu.
// Every type splits its block into P = 8 parts of 32 elements (R = 8 runs of 4). Layouts: ggml-common.h;
// element orders as the dequantize_row_* loops of ggml-quants.c (and gguf_io/quants_k.py).

// byte i (runtime, < 12) of a 12-byte field held in three words
__device__ __forceinline__ u32 byte12(u32 s0, u32 s1, u32 s2, int i) {
    const u32 w = i < 4 ? s0 : (i < 8 ? s1 : s2);
    return (w >> (8 * (i & 3))) & 255u;
}

// get_scale_min_k4 of Q4_K / Q5_K: six-bit scale and min of sub-block j (0..7) from scales[12]
__device__ __forceinline__ void scale_min_k4(u32 s0, u32 s1, u32 s2, int j, float& sc, float& mn) {
    if (j < 4) {
        sc = (float)(byte12(s0, s1, s2, j) & 63u);
        mn = (float)(byte12(s0, s1, s2, j + 4) & 63u);
    } else {
        sc = (float)((byte12(s0, s1, s2, j + 4) & 15u) | ((byte12(s0, s1, s2, j - 4) >> 6) << 4));
        mn = (float)((byte12(s0, s1, s2, j + 4) >> 4) | ((byte12(s0, s1, s2, j) >> 6) << 4));
    }
}

#define LOAD_ARGS const u8 *b, int p, float (&q)[R][4], float (&sc)[R], float (&mn)[R], int (&xo)[R]

// block_q4_K: d, dmin (fp16), scales[12], qs[128]; y = (d * sc) * q - dmin * m per sub-block of 32.
// Part p reads qs[16p .. 16p+15] (one 16-byte load): pair j = p / 2, l0 = 16 (p % 2); low nibbles are
// elements 64j + l0 + l (sub-block 2j), high nibbles 64j + 32 + l0 + l (sub-block 2j + 1).
struct Q4_K {
    static constexpr int BS = 256, TS = 144, P = 8, R = 8;
    static constexpr bool HAS_MIN = true;
    __device__ static __forceinline__ void load(LOAD_ARGS) {
        const float d = ld_f16(b), dmin = ld_f16(b + 2);
        const u32 s0 = ld_u32(b + 4), s1 = ld_u32(b + 8), s2 = ld_u32(b + 12);
        const uint4 qv = *(const uint4*)(b + 16 + 16 * p);
        const u32 qw[4] = {qv.x, qv.y, qv.z, qv.w};
        const int j = p >> 1, l0 = (p & 1) * 16;
        float sc_a, m_a, sc_b, m_b;
        scale_min_k4(s0, s1, s2, 2 * j, sc_a, m_a);
        scale_min_k4(s0, s1, s2, 2 * j + 1, sc_b, m_b);
        const float d_a = d * sc_a, mm_a = dmin * m_a, d_b = d * sc_b, mm_b = dmin * m_b;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 lo = qw[r] & 0x0F0F0F0Fu, hi = (qw[r] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                q[r][k] = magic_byte(lo, k) - MAGIC;
                q[r + 4][k] = magic_byte(hi, k) - MAGIC;
            }
            sc[r] = d_a;
            mn[r] = mm_a;
            sc[r + 4] = d_b;
            mn[r + 4] = mm_b;
            xo[r] = 64 * j + l0 + 4 * r;
            xo[r + 4] = 64 * j + 32 + l0 + 4 * r;
        }
    }
};

// block_q5_K: d, dmin (fp16), scales[12], qh[32], qs[128]; as Q4_K with q = nibble + 16 * bit, the bit of
// element l of sub-block s being bit s of qh[l].
struct Q5_K {
    static constexpr int BS = 256, TS = 176, P = 8, R = 8;
    static constexpr bool HAS_MIN = true;
    __device__ static __forceinline__ void load(LOAD_ARGS) {
        const float d = ld_f16(b), dmin = ld_f16(b + 2);
        const u32 s0 = ld_u32(b + 4), s1 = ld_u32(b + 8), s2 = ld_u32(b + 12);
        const int j = p >> 1, l0 = (p & 1) * 16;
        const uint4 qv = *(const uint4*)(b + 48 + 16 * p);
        const uint4 hv = *(const uint4*)(b + 16 + l0);
        const u32 qw[4] = {qv.x, qv.y, qv.z, qv.w};
        const u32 hw[4] = {hv.x, hv.y, hv.z, hv.w};
        float sc_a, m_a, sc_b, m_b;
        scale_min_k4(s0, s1, s2, 2 * j, sc_a, m_a);
        scale_min_k4(s0, s1, s2, 2 * j + 1, sc_b, m_b);
        const float d_a = d * sc_a, mm_a = dmin * m_a, d_b = d * sc_b, mm_b = dmin * m_b;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 lo = (qw[r] & 0x0F0F0F0Fu) | (((hw[r] >> (2 * j)) & 0x01010101u) << 4);
            const u32 hi = ((qw[r] >> 4) & 0x0F0F0F0Fu) | (((hw[r] >> (2 * j + 1)) & 0x01010101u) << 4);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                q[r][k] = magic_byte(lo, k) - MAGIC;
                q[r + 4][k] = magic_byte(hi, k) - MAGIC;
            }
            sc[r] = d_a;
            mn[r] = mm_a;
            sc[r + 4] = d_b;
            mn[r + 4] = mm_b;
            xo[r] = 64 * j + l0 + 4 * r;
            xo[r + 4] = 64 * j + 32 + l0 + 4 * r;
        }
    }
};

// block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16). Element h*128 + k*32 + l: low bits from
// ql[h*64 + (k%2)*32 + l] (low nibble for k < 2, high for k >= 2), high bits (qh[h*32 + l] >> 2k) & 3,
// y = (d * sc[e / 16]) * (q - 32). Part p: h = p / 4, l0 = 8 (p % 4), covering l0 .. l0+7 for all four k.
struct Q6_K {
    static constexpr int BS = 256, TS = 210, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(LOAD_ARGS) {
        const int h = p >> 2, l0 = (p & 3) * 8;
        const float d = ld_f16(b + 208);
        const u32 qa[2] = {ld_u32_a2(b + h * 64 + l0), ld_u32_a2(b + h * 64 + l0 + 4)};
        const u32 qb[2] = {ld_u32_a2(b + h * 64 + 32 + l0), ld_u32_a2(b + h * 64 + 32 + l0 + 4)};
        const u32 qh[2] = {ld_u32_a2(b + 128 + h * 32 + l0), ld_u32_a2(b + 128 + h * 32 + l0 + 4)};
        const i8* scs = (const i8*)(b + 192);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float dl = d * (float)scs[h * 8 + 2 * k + (l0 >> 4)];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const u32 ql = (k & 1) ? qb[half] : qa[half];
                const int r = 2 * k + half;
                const u32 v = ((ql >> (4 * (k >> 1))) & 0x0F0F0F0Fu) | (((qh[half] >> (2 * k)) & 0x03030303u) << 4);
#pragma unroll
                for (int e = 0; e < 4; ++e) q[r][e] = magic_byte(v, e) - (MAGIC + 32.0f);
                sc[r] = dl;
                mn[r] = 0.0f;
                xo[r] = h * 128 + 32 * k + l0 + 4 * half;
            }
        }
    }
};

// block_q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin (fp16). Element h*128 + j*32 + l:
// q = (qs[h*32 + l] >> 2j) & 3, y = (d * (sc & 15)) * q - dmin * (sc >> 4), sc = scales[e / 16].
struct Q2_K {
    static constexpr int BS = 256, TS = 84, P = 8, R = 8;
    static constexpr bool HAS_MIN = true;
    __device__ static __forceinline__ void load(LOAD_ARGS) {
        const int h = p >> 2, l0 = (p & 3) * 8;
        const float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
        const u32 qw[2] = {ld_u32(b + 16 + h * 32 + l0), ld_u32(b + 16 + h * 32 + l0 + 4)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 s = b[h * 8 + 2 * j + (l0 >> 4)];
            const float dl = d * (float)(s & 15u), ml = dmin * (float)(s >> 4);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = 2 * j + half;
                const u32 v = (qw[half] >> (2 * j)) & 0x03030303u;
#pragma unroll
                for (int e = 0; e < 4; ++e) q[r][e] = magic_byte(v, e) - MAGIC;
                sc[r] = dl;
                mn[r] = ml;
                xo[r] = h * 128 + 32 * j + l0 + 4 * half;
            }
        }
    }
};

// block_q3_K: hmask[32], qs[64], scales[12], d (fp16). Element h*128 + j*32 + l: low = (qs[h*32 + l] >> 2j) & 3,
// q = low - (bit (4h + j) of hmask[l] ? 0 : 4), y = (d * (sc - 32)) * q with the six-bit scale i = e / 16:
// low 4 bits from scales[i] (i < 8, low nibble) or scales[i - 8] (high nibble), high 2 bits
// (scales[8 + i%4] >> 2 (i/4)) & 3.
struct Q3_K {
    static constexpr int BS = 256, TS = 110, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(LOAD_ARGS) {
        const int h = p >> 2, l0 = (p & 3) * 8;
        const float d = ld_f16(b + 108);
        const u32 s0 = ld_u32_a2(b + 96), s1 = ld_u32_a2(b + 100), s2 = ld_u32_a2(b + 104);
        const u32 qw[2] = {ld_u32_a2(b + 32 + h * 32 + l0), ld_u32_a2(b + 32 + h * 32 + l0 + 4)};
        const u32 hm[2] = {ld_u32_a2(b + l0), ld_u32_a2(b + l0 + 4)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = h * 8 + 2 * j + (l0 >> 4);
            const u32 low4 = i < 8 ? (byte12(s0, s1, s2, i) & 15u) : (byte12(s0, s1, s2, i - 8) >> 4);
            const u32 high2 = (byte12(s0, s1, s2, 8 + (i & 3)) >> (2 * (i >> 2))) & 3u;
            const float dl = d * (float)((int)(low4 | (high2 << 4)) - 32);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = 2 * j + half;
                // low + 4 * hbit in 0..7, i.e. q + 4
                const u32 v = ((qw[half] >> (2 * j)) & 0x03030303u) | (((hm[half] >> (4 * h + j)) & 0x01010101u) << 2);
#pragma unroll
                for (int e = 0; e < 4; ++e) q[r][e] = magic_byte(v, e) - (MAGIC + 4.0f);
                sc[r] = dl;
                mn[r] = 0.0f;
                xo[r] = h * 128 + 32 * j + l0 + 4 * half;
            }
        }
    }
};

// block_iq4_xs: d (fp16), scales_h (u16), scales_l[4], qs[128]. Sub-block ib (32 elements) = part p:
// ls = ((scales_l[ib/2] >> 4 (ib%2)) & 15) | ((scales_h >> 2ib) & 3) << 4, y = (d * (ls - 32)) * kvalues[nibble];
// qs[16ib .. 16ib+15]: low nibbles are elements 32ib + 0..15, high nibbles 32ib + 16..31.
struct IQ4_XS {
    static constexpr int BS = 256, TS = 136, P = 8, R = 8;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(LOAD_ARGS) {
        const float d = ld_f16(b);
        const u32 sh = ld_u16(b + 2);
        const u32 sl = b[4 + (p >> 1)];
        const u32 ls = ((sl >> (4 * (p & 1))) & 15u) | (((sh >> (2 * p)) & 3u) << 4);
        const float dl = d * (float)((int)ls - 32);
        const uint2 qa = *(const uint2*)(b + 8 + 16 * p);
        const uint2 qb = *(const uint2*)(b + 16 + 16 * p);
        const u32 qw[4] = {qa.x, qa.y, qb.x, qb.y};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                q[r][k] = magic(iq4nl_u((qw[r] >> (8 * k)) & 15u)) - (MAGIC + 128.0f);
                q[r + 4][k] = magic(iq4nl_u((qw[r] >> (8 * k + 4)) & 15u)) - (MAGIC + 128.0f);
            }
            sc[r] = sc[r + 4] = dl;
            mn[r] = mn[r + 4] = 0.0f;
            xo[r] = 32 * p + 4 * r;
            xo[r + 4] = 32 * p + 16 + 4 * r;
        }
    }
};

QUANT_ENTRIES(q2_k, Q2_K)
QUANT_ENTRIES(q3_k, Q3_K)
QUANT_ENTRIES(q4_k, Q4_K)
QUANT_ENTRIES(q5_k, Q5_K)
QUANT_ENTRIES(q6_k, Q6_K)
QUANT_ENTRIES(iq4_xs, IQ4_XS)
