// matvec_legacy.cu: ggml's 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) for matvec_common.cu.
// Every type splits its block into P = 2 parts of 16 elements; the 4-bit types keep element j in the low nibble
// and element j + 16 in the high nibble of qs[j], so part p reads qs[8p .. 8p+7] and covers elements
// 8p .. 8p+7 and 16+8p .. 16+8p+7 (runs xo = 8p, 8p+4, 16+8p, 20+8p). Word r & 1 of the part, nibble r >> 1.

__device__ __forceinline__ void nibble_runs(int p, int (&xo)[4]) {
    xo[0] = 8 * p;
    xo[1] = 8 * p + 4;
    xo[2] = 16 + 8 * p;
    xo[3] = 20 + 8 * p;
}

// the 4 nibbles (low: hi = 0, high: hi = 1) of a word as 4 bytes
__device__ __forceinline__ u32 nibbles4(u32 w, int hi) { return (w >> (4 * hi)) & 0x0F0F0F0Fu; }

// block_q4_0: d (fp16), qs[16]; y = (q - 8) * d
struct Q4_0 {
    static constexpr int BS = 32, TS = 18, P = 2, R = 4;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(const u8* b, int p, float (&q)[R][4], float (&sc)[R], float (&mn)[R],
                                                int (&xo)[R]) {
        const float d = ld_f16(b);
        const u32 w[2] = {ld_u32_a2(b + 2 + 8 * p), ld_u32_a2(b + 6 + 8 * p)};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 v = nibbles4(w[r & 1], r >> 1);
#pragma unroll
            for (int k = 0; k < 4; ++k) q[r][k] = magic_byte(v, k) - (MAGIC + 8.0f);
            sc[r] = d;
            mn[r] = 0.0f;
        }
        nibble_runs(p, xo);
    }
};

// block_q4_1: d, m (fp16), qs[16]; y = q * d + m
struct Q4_1 {
    static constexpr int BS = 32, TS = 20, P = 2, R = 4;
    static constexpr bool HAS_MIN = true;
    __device__ static __forceinline__ void load(const u8* b, int p, float (&q)[R][4], float (&sc)[R], float (&mn)[R],
                                                int (&xo)[R]) {
        const float d = ld_f16(b), m = ld_f16(b + 2);
        const u32 w[2] = {ld_u32(b + 4 + 8 * p), ld_u32(b + 8 + 8 * p)};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 v = nibbles4(w[r & 1], r >> 1);
#pragma unroll
            for (int k = 0; k < 4; ++k) q[r][k] = magic_byte(v, k) - MAGIC;
            sc[r] = d;
            mn[r] = -m;
        }
        nibble_runs(p, xo);
    }
};

// the fifth bits of elements xo .. xo+3 (bits xo.. of qh) moved to bit 4 of each byte
__device__ __forceinline__ u32 high_bits4(u32 qh, int xo) {
    const u32 h = (qh >> xo) & 15u;
    return ((h & 1u) << 4) | ((h & 2u) << 11) | ((h & 4u) << 18) | ((h & 8u) << 25);
}

// block_q5_0: d (fp16), qh[4], qs[16]; y = ((nibble | bit j of qh << 4) - 16) * d
struct Q5_0 {
    static constexpr int BS = 32, TS = 22, P = 2, R = 4;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(const u8* b, int p, float (&q)[R][4], float (&sc)[R], float (&mn)[R],
                                                int (&xo)[R]) {
        const float d = ld_f16(b);
        const u32 qh = ld_u32_a2(b + 2);
        const u32 w[2] = {ld_u32_a2(b + 6 + 8 * p), ld_u32_a2(b + 10 + 8 * p)};
        nibble_runs(p, xo);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 v = nibbles4(w[r & 1], r >> 1) | high_bits4(qh, xo[r]);
#pragma unroll
            for (int k = 0; k < 4; ++k) q[r][k] = magic_byte(v, k) - (MAGIC + 16.0f);
            sc[r] = d;
            mn[r] = 0.0f;
        }
    }
};

// block_q5_1: d, m (fp16), qh[4], qs[16]; y = (nibble | bit j of qh << 4) * d + m
struct Q5_1 {
    static constexpr int BS = 32, TS = 24, P = 2, R = 4;
    static constexpr bool HAS_MIN = true;
    __device__ static __forceinline__ void load(const u8* b, int p, float (&q)[R][4], float (&sc)[R], float (&mn)[R],
                                                int (&xo)[R]) {
        const float d = ld_f16(b), m = ld_f16(b + 2);
        const u32 qh = ld_u32(b + 4);
        const u32 w[2] = {ld_u32(b + 8 + 8 * p), ld_u32(b + 12 + 8 * p)};
        nibble_runs(p, xo);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 v = nibbles4(w[r & 1], r >> 1) | high_bits4(qh, xo[r]);
#pragma unroll
            for (int k = 0; k < 4; ++k) q[r][k] = magic_byte(v, k) - MAGIC;
            sc[r] = d;
            mn[r] = -m;
        }
    }
};

// block_q8_0: d (fp16), qs[32] (int8); y = q * d. Part p covers elements 16p .. 16p+15.
struct Q8_0 {
    static constexpr int BS = 32, TS = 34, P = 2, R = 4;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(const u8* b, int p, float (&q)[R][4], float (&sc)[R], float (&mn)[R],
                                                int (&xo)[R]) {
        const float d = ld_f16(b);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 v = ld_u32_a2(b + 2 + 16 * p + 4 * r) ^ 0x80808080u;  // int8 q -> q + 128 in each byte
#pragma unroll
            for (int k = 0; k < 4; ++k) q[r][k] = magic_byte(v, k) - (MAGIC + 128.0f);
            sc[r] = d;
            mn[r] = 0.0f;
            xo[r] = 16 * p + 4 * r;
        }
    }
};

// block_iq4_nl: d (fp16), qs[16]; y = d * kvalues_iq4nl[nibble], nibbles ordered as in Q4_0
struct IQ4_NL {
    static constexpr int BS = 32, TS = 18, P = 2, R = 4;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(const u8* b, int p, float (&q)[R][4], float (&sc)[R], float (&mn)[R],
                                                int (&xo)[R]) {
        const float d = ld_f16(b);
        const u32 w[2] = {ld_u32_a2(b + 2 + 8 * p), ld_u32_a2(b + 6 + 8 * p)};
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int k = 0; k < 4; ++k)
                q[r][k] = magic(iq4nl_u((w[r & 1] >> (8 * k + 4 * (r >> 1))) & 15u)) - (MAGIC + 128.0f);
            sc[r] = d;
            mn[r] = 0.0f;
        }
        nibble_runs(p, xo);
    }
};

// ggml_e8m0_to_fp32_half: 2^(e - 128) as float bits (subnormal for e < 2)
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
}

// kvalues_mxfp4 (ggml-common.h), the e2m1 values doubled: 0, 1, 2, 3, 4, 6, 8, 12, then the same negated
__device__ __forceinline__ float mxfp4_value(u32 n) {
    const u32 m = __byte_perm(0x03020100u, 0x0C080604u, n & 7u) & 255u;  // byte n & 7 of {0,1,2,3,4,6,8,12}
    return (float)((n & 8u) ? -(int)m : (int)m);  // kvalues[8] is +0
}

// block_mxfp4: e (e8m0), qs[16]; y = 2^(e - 128) * kvalues_mxfp4[nibble], nibbles ordered as in Q4_0. 17-byte
// blocks: every field is read byte by byte.
struct MXFP4 {
    static constexpr int BS = 32, TS = 17, P = 2, R = 4;
    static constexpr bool HAS_MIN = false;
    __device__ static __forceinline__ void load(const u8* b, int p, float (&q)[R][4], float (&sc)[R], float (&mn)[R],
                                                int (&xo)[R]) {
        const float d = e8m0_half(b[0]);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int k = 0; k < 4; ++k) q[r][k] = mxfp4_value((u32)b[1 + 8 * p + 4 * (r & 1) + k] >> (4 * (r >> 1)));
            sc[r] = d;
            mn[r] = 0.0f;
        }
        nibble_runs(p, xo);
    }
};

QUANT_ENTRIES(q4_0, Q4_0)
QUANT_ENTRIES(q4_1, Q4_1)
QUANT_ENTRIES(q5_0, Q5_0)
QUANT_ENTRIES(q5_1, Q5_1)
QUANT_ENTRIES(q8_0, Q8_0)
QUANT_ENTRIES(iq4_nl, IQ4_NL)
QUANT_ENTRIES(mxfp4, MXFP4)
