// matvec_mmq_q6k.cu (after matvec_q8_staged.cu and matvec_mmq.cu): y = x W^T for 2-64 tokens of q8 activations and
// block_q6_K rows on the tensor cores, the Q6_K sibling of mmq_q4_k_body (same launch, same packed activations).
// Q6_K has a signed 8-bit scale for every 16 values, so one mma.sync m16n8k16 (int8 in, int32 out) gives one
// 16-value group's integer sums for 16 rows x 8 tokens; the two groups of a 32-value sub-block are scaled and added
// in int32 (|q| <= 32, |x| <= 127, 16 terms, |scale| <= 128: far below 2^31), then in float32 by the token's q8
// scale and the block's d. A value is q - 32 in int8 (q the 6-bit code): per byte,
// ((q | 0x80) - 0x20) ^ 0x80, no borrow across bytes.
// A 210-byte block is only 2-byte aligned, so a warp stages its 16 rows of a block through shared memory with
// 16-byte cp.async (14 aligned pieces a row hold every byte of it, as stage_span's), MMQ6_STAGES blocks in flight,
// and reads the fields from there: a row's staged copy starts at byte o = (address & 15) of its 240-byte slot (the
// slot stride puts the 8 rows a load reads on different banks). Lane (g, t) reads, per half n of the block and
// group h, the 4 bytes at 16h + 4t of ql[64n..], ql[64n + 32..] and qh[32n..] of rows g and g + 8: with them it
// holds its 4 values of the group for all four sub-blocks of that half. The activations' group h is their bytes
// 16h + 4t of the q8 block (the same element order for both operands).

#ifndef MMQ6_STAGES
#define MMQ6_STAGES 3  // blocks a warp has in flight (shared memory: MMQ_WARPS x MMQ6_STAGES x 16 RT x 240 bytes)
#endif
#define MMQ6_SLOT 240   // bytes a row's staged block takes (14 pieces of 16 used)
#define MMQ6_PIECES 14  // 16-byte pieces that hold a 210-byte block starting at an even offset within its first

// c += a (16x16 int8, row major) * b (16x8 int8, column major), PTX's fragment layouts for m16n8k16 .s8:
// a[0] row g, k 4t..4t+3; a[1] row g + 8, same k; b[0] k 4t..4t+3 of column g; c as m16n8k32's
__device__ __forceinline__ void mma_s8_16816(int (&c)[4], u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

// the 4 bytes at even byte offset x of the staged slot s4 (aligned words: one, or two shifted together)
__device__ __forceinline__ u32 lds_u32_a2(const u32* s4, u32 x) {
    const u32 lo = s4[x >> 2];
    return (x & 2u) ? __funnelshift_r(lo, s4[(x >> 2) + 1], 16) : lo;
}

// 4 six-bit codes (low nibbles from l at bit `ls`, high bits from h at bit `hs`) as int8 values q - 32
__device__ __forceinline__ u32 q6_vals(u32 l, int ls, u32 h, int hs) {
    const u32 lo = (l >> ls) & 0x0F0F0F0Fu;
    const u32 hi = (hs >= 0 ? (h >> hs) : (h << -hs)) & 0x30303030u;
    return ((lo | hi | 0x80808080u) - 0x20202020u) ^ 0x80808080u;
}

// block b of row `row` in global memory (rows past the end clamped to the last one, re-read and never stored)
__device__ __forceinline__ const u8* q6_block(const u8* w, size_t row_bytes, int row, int n_out, int b) {
    return w + (size_t)min(row, n_out - 1) * row_bytes + (size_t)b * 210;
}

// a warp's 16 RT rows of block b into its stage slots, 14 pieces a row; a row's block starts at (address & 15)
template <int RT>
__device__ __forceinline__ void mmq6_stage(u8* st, const u8* w, size_t row_bytes, int row0, int n_out, int b,
                                           int lane) {
    for (int j = lane; j < 16 * RT * MMQ6_PIECES; j += WARP) {
        const int r = j / MMQ6_PIECES, p = j % MMQ6_PIECES;
        const u8* src = q6_block(w, row_bytes, row0 + r, n_out, b);
        cp_async16(st + r * MMQ6_SLOT + 16 * p, (const u8*)(((size_t)src & ~(size_t)15) + 16 * p));
    }
}

// one 16-row tile's block as lane (g, t) reads it from the stage: rows g and g + 8, their staged offsets, scales, d
struct Q6Tile {
    const u32* sa4;
    const u32* sb4;
    u32 oa, ob;
    u32 sca[4], scb[4];  // the 16 int8 scales of rows g and g + 8
    float da, db;
};

template <int NG, int RT>
__device__ __forceinline__ void mmq_q6_k_body(const u8* __restrict__ w, const i8* __restrict__ pq,
                                              const float4* __restrict__ pm, float* __restrict__ y, int n_out,
                                              int n_blocks, int ntok, int wpr, int cta) {
    constexpr int T = 8 * NG, SLOTS = 16 * RT;  // a stage holds the warp's 16 RT rows of one block
    extern __shared__ __align__(16) u8 mmq_smem[];  // MMQ_WARPS x MMQ6_STAGES x SLOTS x 240 bytes
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = (cta * (MMQ_WARPS / wpr) + warp / wpr) * 16 * RT;  // cta: this CTA's index (blockIdx.x)
    const int sub = warp % wpr;
    const size_t row_bytes = (size_t)n_blocks * 210;
    u8* stage = mmq_smem + (size_t)warp * MMQ6_STAGES * SLOTS * MMQ6_SLOT;
    float acc[RT][NG][4];  // as mmq_q4_k_body's
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int q = 0; q < NG; ++q) acc[r][q][0] = acc[r][q][1] = acc[r][q][2] = acc[r][q][3] = 0.0f;
    if (row0 < n_out) {
        const i8* xg = pq + 32 * g + 4 * t;  // B: token 8q + g's bytes 16h + 4t of q8 block k: xg + 32 (T k + 8q) + 16h
        const float4* ms = pm + t;
#pragma unroll
        for (int s = 0; s < MMQ6_STAGES - 1; ++s) {
            const int b = sub + s * wpr;
            if (b < n_blocks) mmq6_stage<RT>(stage + s * SLOTS * MMQ6_SLOT, w, row_bytes, row0, n_out, b, lane);
            cp_async_commit();
        }
        int slot = 0;
        for (int b = sub; b < n_blocks; b += wpr) {
            const int bn = b + (MMQ6_STAGES - 1) * wpr;  // into the slot the last iteration read (released below)
            if (bn < n_blocks) {
                const int sn = slot == 0 ? MMQ6_STAGES - 1 : slot - 1;
                mmq6_stage<RT>(stage + sn * SLOTS * MMQ6_SLOT, w, row_bytes, row0, n_out, bn, lane);
            }
            cp_async_commit();  // possibly empty: one group an iteration keeps the count below uniform
            cp_async_wait<MMQ6_STAGES - 1>();
            __syncwarp();
            Q6Tile tl[RT];
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                const u8* sa = stage + (slot * SLOTS + 16 * r + g) * MMQ6_SLOT;
                const u8* sb = sa + 8 * MMQ6_SLOT;
                tl[r].sa4 = (const u32*)sa;
                tl[r].sb4 = (const u32*)sb;
                tl[r].oa = (u32)((size_t)q6_block(w, row_bytes, row0 + 16 * r + g, n_out, b) & 15u);
                tl[r].ob = (u32)((size_t)q6_block(w, row_bytes, row0 + 16 * r + g + 8, n_out, b) & 15u);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    tl[r].sca[i] = lds_u32_a2(tl[r].sa4, tl[r].oa + 192 + 4 * i);
                    tl[r].scb[i] = lds_u32_a2(tl[r].sb4, tl[r].ob + 192 + 4 * i);
                }
                tl[r].da = h2f(*(const u16*)(sa + tl[r].oa + 208));
                tl[r].db = h2f(*(const u16*)(sb + tl[r].ob + 208));
            }
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                u32 l0a[RT][2], l1a[RT][2], qha[RT][2], l0b[RT][2], l1b[RT][2], qhb[RT][2];  // per tile, group h
#pragma unroll
                for (int r = 0; r < RT; ++r)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const u32 f = 16 * h + 4 * t;
                        l0a[r][h] = lds_u32_a2(tl[r].sa4, tl[r].oa + 64 * n + f);
                        l1a[r][h] = lds_u32_a2(tl[r].sa4, tl[r].oa + 64 * n + 32 + f);
                        qha[r][h] = lds_u32_a2(tl[r].sa4, tl[r].oa + 128 + 32 * n + f);
                        l0b[r][h] = lds_u32_a2(tl[r].sb4, tl[r].ob + 64 * n + f);
                        l1b[r][h] = lds_u32_a2(tl[r].sb4, tl[r].ob + 64 * n + 32 + f);
                        qhb[r][h] = lds_u32_a2(tl[r].sb4, tl[r].ob + 128 + 32 * n + f);
                    }
#pragma unroll
                for (int m = 0; m < 4; ++m) {  // sub-block 4n + m: ql[64n (+32 for odd m)], nibble m / 2, qh bits 2m
                    const int ls = 4 * (m >> 1), hs = 2 * m - 4;
                    const size_t kb = (size_t)(8 * b + 4 * n + m);
                    int isum[RT][NG][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int si = 8 * n + 2 * m + h;  // the group's scale index
                        u32 aa[RT], ab[RT];
                        int sa_[RT], sb_[RT];
#pragma unroll
                        for (int r = 0; r < RT; ++r) {
                            aa[r] = q6_vals(m & 1 ? l1a[r][h] : l0a[r][h], ls, qha[r][h], hs);
                            ab[r] = q6_vals(m & 1 ? l1b[r][h] : l0b[r][h], ls, qhb[r][h], hs);
                            sa_[r] = (int)(i8)(tl[r].sca[si >> 2] >> (8 * (si & 3)));
                            sb_[r] = (int)(i8)(tl[r].scb[si >> 2] >> (8 * (si & 3)));
                        }
#pragma unroll
                        for (int q = 0; q < NG; ++q) {
                            const u32 bx = __ldg((const u32*)(xg + (kb * T + 8 * q) * 32 + 16 * h));
#pragma unroll
                            for (int r = 0; r < RT; ++r) {
                                int c[4] = {0, 0, 0, 0};
                                mma_s8_16816(c, aa[r], ab[r], bx);
                                if (h == 0) {
                                    isum[r][q][0] = sa_[r] * c[0];
                                    isum[r][q][1] = sa_[r] * c[1];
                                    isum[r][q][2] = sb_[r] * c[2];
                                    isum[r][q][3] = sb_[r] * c[3];
                                } else {
                                    isum[r][q][0] += sa_[r] * c[0];
                                    isum[r][q][1] += sa_[r] * c[1];
                                    isum[r][q][2] += sb_[r] * c[2];
                                    isum[r][q][3] += sb_[r] * c[3];
                                }
                            }
                        }
                    }
#pragma unroll
                    for (int q = 0; q < NG; ++q) {
                        const float4 v = __ldg(ms + kb * (T / 2) + 4 * q);  // tokens 8q + 2t, + 1: d (x, z)
#pragma unroll
                        for (int r = 0; r < RT; ++r) {
                            acc[r][q][0] = fmaf(tl[r].da * v.x, (float)isum[r][q][0], acc[r][q][0]);
                            acc[r][q][1] = fmaf(tl[r].da * v.z, (float)isum[r][q][1], acc[r][q][1]);
                            acc[r][q][2] = fmaf(tl[r].db * v.x, (float)isum[r][q][2], acc[r][q][2]);
                            acc[r][q][3] = fmaf(tl[r].db * v.z, (float)isum[r][q][3], acc[r][q][3]);
                        }
                    }
                }
            }
            __syncwarp();  // every lane is done with this slot before it is refilled
            slot = slot == MMQ6_STAGES - 1 ? 0 : slot + 1;
        }
        cp_async_wait<0>();
    }
    mmq_store<NG, RT>(acc, (float*)mmq_smem, warp, lane, sub, wpr, row0, n_out, ntok, y);
}

MMQ_ENTRIES(q6_k, mmq_q6_k_body)
