"""SIMD dot products of raw 256-element GGML super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) with Q8_K
activations, as ggml's ggml_vec_dot_*_q8_K on AVX2, plus the float32 row decoders the batched GEMM uses; the
codebook types (IQ1/IQ2/IQ3, kernels_cpu.vec_dot_iq) share the driver through kind codes from vec_dot_iq.FIRST_KIND.

Per 32 weights the codes are unpacked into one 32-byte vector (`simd`), multiplied with the int8 activations
(vpmaddubsw) and by their sub-block's integer scale (vpmaddwd with the scale in each 16-bit lane: one scale per
32, or two per 32 for the 16-element sub-blocks of Q2_K, Q3_K, Q6_K), summed exactly in int32 lanes per
super-block and accumulated in float32 with d_w * d_x. The mins of Q2_K, Q4_K, Q5_K use the Q8_K block's
16-element sums: y -= dmin * d_x * sum_g min_g * bsums_g; for Q4_K/Q5_K as ggml's AVX2 kernels, one vpmaddwd of the
8 mins with the sums per block, accumulated in float lanes (Q2_K: in integers up to that last product).
Signed codes (Q3_K, Q6_K q-32, IQ4_XS levels) go through |q| and sign(q) * q8 like ggml.

Activations: xq int8 (n_tok, n_in), xd float32 (n_tok, n_in/256), bsums int16 (n_tok, n_in/16).
Weight offsets are linear byte offsets into the C-contiguous (n_out, row_bytes) w.
Small batches: Q4_K_X8 and Q6_K pass each block of rows once per 4 tokens (kernels_cpu.k_tokens.rows_dot4), each
output equal to the 1-token kernel's bit for bit.
"""

import numpy as np
from numba import njit, prange

from kernels_cpu import iq4_xs_x8, k_tokens, q4_k_x8, vec_dot_iq
from kernels_cpu.q4_k_x8 import scale_min_k4
from kernels_cpu.sched import next_task
from kernels_cpu.simd import (cvt_f32, fma_f32, hsum_f32, load_f16, load_i8x32, load_i16x16, load_nib16, load_u32,
                              prefetch, store_scaled, zero_f32)
from kernels_cpu.simd_int import (abs_i8, add_i32, addc_i8, and_i8, lut16_i8, madd, maddubs, or_i8, shl_i8, shr_i8,
                                  sign_i8, splat2_i16, splat_i16, splat_i8, zero_i32)
from kernels_cpu.simd_k import (K4_SCALE_SHUF, K6_SCALE_SHUF, maddubs_32, mins_pairs_from_u64, scale_pair_i32,
                                scales_from_u64, scales_i8x8, shuffle_scales, sub_i16)
from kernels_cpu.simd_x8 import dpbusd, has_vnni, mul_i32, sub_i32
from kernels_cpu.vec_dot_legacy import KVALUES_IQ4NL, prefetch_distance

QK_K = 256
PREFETCH_BYTES = 4096
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = 0, 1, 2, 3, 4, 5  # type codes (one compiled driver for all of them)
Q4_K_X8 = 6  # Q4_K rows interleaved by 8 (kernels_cpu.q4_k_x8): calls cover whole groups of 8 rows
TYPE_SIZE = np.array([84, 110, 144, 176, 210, 136, 148], dtype=np.int64)
IQ4_XS_X8 = 14  # IQ4_XS rows interleaved by 8 (kernels_cpu.iq4_xs_x8), after vec_dot_iq's kinds 7..13


# -- scales -----------------------------------------------------------------------------------------------------
@njit(inline="always")
def scales_mins_k4(w, o):
    """The 8 scales and 8 mins of the q4_K/q5_K block at byte o, one per byte of two int64 (ggml's utmp)."""
    u0, u1, u2 = load_u32(w, o + 4), load_u32(w, o + 8), load_u32(w, o + 12)
    s_hi = (u2 & 0x0F0F0F0F) | (((u0 >> 6) & 0x03030303) << 4)
    m_hi = ((u2 >> 4) & 0x0F0F0F0F) | (((u1 >> 6) & 0x03030303) << 4)
    return (u0 & 0x3F3F3F3F) | (s_hi << 32), (u1 & 0x3F3F3F3F) | (m_hi << 32)


@njit(inline="always")
def scale_q3_k(w, o, j):
    """The 6-bit scale of sub-block j (0..15) of the block_q3_K at byte o (scales[12] at 96), minus 32."""
    b = np.int32(w[o + 96 + j % 8])
    low = b & 0xF if j < 8 else b >> 4
    high = (np.int32(w[o + 104 + j % 4]) >> (2 * (j // 4))) & 3
    return (low | (high << 4)) - 32


@njit(inline="always")
def scale_q6_k(w, o, g):
    s = np.int32(w[o + 192 + g])
    return s - ((s & 128) << 1)  # int8


@njit(inline="always")
def scale_iq4_xs(w, o, ib):
    scales_h = np.int32(w[o + 2]) | (np.int32(w[o + 3]) << 8)
    low = (np.int32(w[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF
    return (low | (((scales_h >> (2 * ib)) & 3) << 4)) - 32


# -- codes of 32 weights (g: which 32, 0..7), as one I8x32 -----------------------------------------------------
@njit(inline="always")
def codes_q2_k(w, o, g):
    # block_q2_K: scales[16], qs[64] at 16, d, dmin at 80; element 128k + 32j + l = (qs[32k + l] >> 2j) & 3
    k, j = g // 4, g % 4
    return and_i8(shr_i8(load_i8x32(w, o + 16 + 32 * k), 2 * j), 3)


@njit(inline="always")
def codes_q3_k(w, o, g):
    # block_q3_K: hmask[32], qs[64] at 32, scales[12] at 96, d at 108; element 128k + 32j + l =
    # ((qs[32k + l] >> 2j) & 3) - (0 if bit 4k + j of hmask[l] else 4)
    k, j = g // 4, g % 4
    low = and_i8(shr_i8(load_i8x32(w, o + 32 + 32 * k), 2 * j), 3)
    high = shl_i8(and_i8(shr_i8(load_i8x32(w, o), g), 1), 2)
    return addc_i8(or_i8(low, high), -4)


@njit(inline="always")
def codes_q4_k(w, o, g):
    # block_q4_K: d, dmin, scales[12], qs[128] at 16; element 64j + l = qs[32j + l] & 15, 64j + 32 + l: >> 4
    q = load_i8x32(w, o + 16 + 32 * (g // 2))
    return and_i8(q, 15) if g % 2 == 0 else shr_i8(q, 4)


@njit(inline="always")
def codes_q5_k(w, o, g):
    # block_q5_K: d, dmin, scales[12], qh[32] at 16, qs[128] at 48; q4_K plus bit g of qh[l] as the 5th bit
    q = load_i8x32(w, o + 48 + 32 * (g // 2))
    low = and_i8(q, 15) if g % 2 == 0 else shr_i8(q, 4)
    return or_i8(low, shl_i8(and_i8(shr_i8(load_i8x32(w, o + 16), g), 1), 4))


@njit(inline="always")
def codes_q6_k(w, o, g):
    # block_q6_K: ql[128], qh[64] at 128, scales[16] at 192, d at 208; with h = g // 4, s = g % 4:
    # element 128h + 32s + l = (low | high << 4) - 32, low = ql[64h + 32(s & 1) + l] & 15 (s < 2) or >> 4,
    # high = (qh[32h + l] >> 2s) & 3
    h, s = g // 4, g % 4
    ql = load_i8x32(w, o + 64 * h + 32 * (s & 1))
    low = and_i8(ql, 15) if s < 2 else shr_i8(ql, 4)
    high = and_i8(shr_i8(load_i8x32(w, o + 128 + 32 * h), 2 * s), 3)
    return addc_i8(or_i8(low, shl_i8(high, 4)), -32)


@njit(inline="always")
def codes_iq4_xs(w, o, g):
    # block_iq4_xs: d, scales_h, scales_l[4], qs[128] at 8; element 32g + j = kvalues[qs[16g + j] & 15],
    # 32g + 16 + j = kvalues[qs[16g + j] >> 4]
    return lut16_i8(load_nib16(w, o + 8 + 16 * g), KVALUES_IQ4NL, 0)


# -- two weight rows . one token's Q8_K activations: dot2_<type>(w, wo, rb, xq, xd, bsums, nb) ---------------
# Rows at bytes wo and wo + rb (nb super-blocks) . one token (xq, xd, bsums: its rows of the activation
# arrays). As in vec_dot_legacy: two adjacent rows per pass, one function per type, the small helpers inlined
# (inline="always": with cached callees LLVM cannot inline them), and a software prefetch
# prefetch_distance(rb, PREFETCH_BYTES) ahead in the pair's stream (vec_dot_legacy.prefetch_distance; for
# Q4_K/Q5_K it replaced a prefetch in each row's own stream).
@njit(inline="always")
def isum_q2_k_half(w, o, k, x, bsums, bo):
    """Exact int32 lanes of sum scale * q * q8 over elements 128k .. 128k + 127 of the q2_K block at o, and
    the integer min term sum min * bsums of its 8 sub-blocks (bsums of the block from bo)."""
    q = load_i8x32(w, o + 16 + 32 * k)
    sa, sb = load_u32(w, o + 8 * k), load_u32(w, o + 8 * k + 4)  # scale | min << 4 of sub-blocks 8k..8k+7
    acc = zero_i32()
    imin = 0
    for j in range(4):
        word = sa if j < 2 else sb
        c0, c1 = (word >> (16 * (j % 2))) & 255, (word >> (16 * (j % 2) + 8)) & 255
        p = maddubs(and_i8(shr_i8(q, 2 * j), 3), load_i8x32(x, 128 * k + 32 * j))
        acc = add_i32(acc, madd(p, splat2_i16(c0 & 15, c1 & 15)))
        imin += (c0 >> 4) * np.int32(bsums[bo + 8 * k + 2 * j]) + (c1 >> 4) * np.int32(bsums[bo + 8 * k + 2 * j + 1])
    return acc, imin


@njit(cache=True, fastmath=True)
def dot2_q2_k(w, wo, rb, xq, xd, bsums, nb):
    a0, a1 = zero_f32(), zero_f32()
    m0, m1 = np.float32(0.0), np.float32(0.0)
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for i in range(nb):
        o, dx = wo + i * 84, xd[i]
        xs = xq[i * QK_K:(i + 1) * QK_K]
        s0, s1 = zero_i32(), zero_i32()
        i0, i1 = 0, 0
        for k in range(2):
            for line in range(2):
                prefetch(w, wo + 2 * i * 84 + pf + 128 * k + 64 * line)
            v, m = isum_q2_k_half(w, o, k, xs, bsums, 16 * i)
            s0, i0 = add_i32(s0, v), i0 + m
            v, m = isum_q2_k_half(w, o + rb, k, xs, bsums, 16 * i)
            s1, i1 = add_i32(s1, v), i1 + m
        a0 = fma_f32(a0, cvt_f32(s0), load_f16(w, o + 80) * dx)
        a1 = fma_f32(a1, cvt_f32(s1), load_f16(w, o + rb + 80) * dx)
        m0 += load_f16(w, o + 82) * dx * np.float32(i0)
        m1 += load_f16(w, o + rb + 82) * dx * np.float32(i1)
    return hsum_f32(a0) - m0, hsum_f32(a1) - m1


@njit(inline="always")
def scales_q3_k(w, o):
    """The 16 6-bit scales (+32) of the q3_K block at byte o, one per byte of two int64 (ggml's aux)."""
    a0, a1, tmp = load_u32(w, o + 96), load_u32(w, o + 100), load_u32(w, o + 104)
    s0 = (a0 & 0x0F0F0F0F) | ((tmp & 0x03030303) << 4)
    s1 = (a1 & 0x0F0F0F0F) | (((tmp >> 2) & 0x03030303) << 4)
    s2 = ((a0 >> 4) & 0x0F0F0F0F) | (((tmp >> 4) & 0x03030303) << 4)
    s3 = ((a1 >> 4) & 0x0F0F0F0F) | (((tmp >> 6) & 0x03030303) << 4)
    return s0 | (s1 << 32), s2 | (s3 << 32)


@njit(inline="always")
def isum_q3_k_half(w, o, k, x, scales):
    """Exact int32 lanes of sum (scale - 32) * q * q8 over elements 128k .. 128k + 127 of the q3_K block at o
    (scales: its sub-blocks 8k..8k+7, one per byte)."""
    q = load_i8x32(w, o + 32 + 32 * k)
    hm = load_i8x32(w, o)
    acc = zero_i32()
    for j in range(4):
        low = and_i8(shr_i8(q, 2 * j), 3)
        c = addc_i8(or_i8(low, shl_i8(and_i8(shr_i8(hm, 4 * k + j), 1), 2)), -4)
        xv = load_i8x32(x, 128 * k + 32 * j)
        acc = add_i32(acc, madd(maddubs(abs_i8(c), sign_i8(xv, c)),
                                splat2_i16(((scales >> (16 * j)) & 255) - 32, ((scales >> (16 * j + 8)) & 255) - 32)))
    return acc


@njit(cache=True, fastmath=True)
def dot2_q3_k(w, wo, rb, xq, xd, bsums, nb):
    a0, a1 = zero_f32(), zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for i in range(nb):
        o, dx = wo + i * 110, xd[i]
        xs = xq[i * QK_K:(i + 1) * QK_K]
        sc0, sc0b = scales_q3_k(w, o)
        sc1, sc1b = scales_q3_k(w, o + rb)
        s0 = add_i32(isum_q3_k_half(w, o, 0, xs, sc0), isum_q3_k_half(w, o, 1, xs, sc0b))
        s1 = add_i32(isum_q3_k_half(w, o + rb, 0, xs, sc1), isum_q3_k_half(w, o + rb, 1, xs, sc1b))
        for line in range(4):
            prefetch(w, wo + 2 * i * 110 + pf + 64 * line)
        a0 = fma_f32(a0, cvt_f32(s0), load_f16(w, o + 108) * dx)
        a1 = fma_f32(a1, cvt_f32(s1), load_f16(w, o + rb + 108) * dx)
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def dot2_q4_k(w, wo, rb, xq, xd, bsums, nb):
    a0, a1 = zero_f32(), zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for i in range(nb):
        o, xb, dx = wo + i * 144, i * QK_K, xd[i]
        sc0, mn0 = scales_mins_k4(w, o)
        sc1, mn1 = scales_mins_k4(w, o + rb)
        v0, v1 = scales_from_u64(sc0), scales_from_u64(sc1)  # the 8 scales in a register, shuffled per sub-block
        bs = load_i16x16(bsums, 16 * i)  # the block's 16 sums of 16 activations, shared by both rows
        s0, s1 = zero_i32(), zero_i32()
        for j in range(4):  # sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
            if j < 3:  # the pair's stream: 3 of its 288 bytes' lines (the hardware prefetcher fills the rest)
                prefetch(w, wo + 2 * i * 144 + pf + 96 * j)
            xl, xh = load_i8x32(xq, xb + 64 * j), load_i8x32(xq, xb + 64 * j + 32)
            q = load_i8x32(w, o + 16 + 32 * j)
            s0 = add_i32(s0, madd(maddubs(and_i8(q, 15), xl), shuffle_scales(v0, K4_SCALE_SHUF, 2 * j)))
            s0 = add_i32(s0, madd(maddubs(shr_i8(q, 4), xh), shuffle_scales(v0, K4_SCALE_SHUF, 2 * j + 1)))
            q = load_i8x32(w, o + rb + 16 + 32 * j)
            s1 = add_i32(s1, madd(maddubs(and_i8(q, 15), xl), shuffle_scales(v1, K4_SCALE_SHUF, 2 * j)))
            s1 = add_i32(s1, madd(maddubs(shr_i8(q, 4), xh), shuffle_scales(v1, K4_SCALE_SHUF, 2 * j + 1)))
        a0 = fma_f32(a0, cvt_f32(s0), load_f16(w, o) * dx)
        a1 = fma_f32(a1, cvt_f32(s1), load_f16(w, o + rb) * dx)
        # the min terms, - dmin * d_x * sum_g min_g * bsum_g, into the same float lanes (g)
        a0 = fma_f32(a0, cvt_f32(madd(mins_pairs_from_u64(mn0), bs)), -(load_f16(w, o + 2) * dx))
        a1 = fma_f32(a1, cvt_f32(madd(mins_pairs_from_u64(mn1), bs)), -(load_f16(w, o + rb + 2) * dx))
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def dot2_q5_k(w, wo, rb, xq, xd, bsums, nb):
    a0, a1 = zero_f32(), zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for i in range(nb):
        o, xb, dx = wo + i * 176, i * QK_K, xd[i]
        sc0, mn0 = scales_mins_k4(w, o)
        sc1, mn1 = scales_mins_k4(w, o + rb)
        bs = load_i16x16(bsums, 16 * i)
        s0, s1 = zero_i32(), zero_i32()
        for j in range(4):  # sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
            if j < 3:  # the pair's stream: 3 of its 352 bytes' lines (the hardware prefetcher fills the rest)
                prefetch(w, wo + 2 * i * 176 + pf + 117 * j)
            xl, xh = load_i8x32(xq, xb + 64 * j), load_i8x32(xq, xb + 64 * j + 32)
            q, qh = load_i8x32(w, o + 48 + 32 * j), load_i8x32(w, o + 16)
            lo = or_i8(and_i8(q, 15), shl_i8(and_i8(shr_i8(qh, 2 * j), 1), 4))
            hi = or_i8(shr_i8(q, 4), shl_i8(and_i8(shr_i8(qh, 2 * j + 1), 1), 4))
            s0 = add_i32(s0, madd(maddubs(lo, xl), splat_i16((sc0 >> (16 * j)) & 255)))
            s0 = add_i32(s0, madd(maddubs(hi, xh), splat_i16((sc0 >> (16 * j + 8)) & 255)))
            q, qh = load_i8x32(w, o + rb + 48 + 32 * j), load_i8x32(w, o + rb + 16)
            lo = or_i8(and_i8(q, 15), shl_i8(and_i8(shr_i8(qh, 2 * j), 1), 4))
            hi = or_i8(shr_i8(q, 4), shl_i8(and_i8(shr_i8(qh, 2 * j + 1), 1), 4))
            s1 = add_i32(s1, madd(maddubs(lo, xl), splat_i16((sc1 >> (16 * j)) & 255)))
            s1 = add_i32(s1, madd(maddubs(hi, xh), splat_i16((sc1 >> (16 * j + 8)) & 255)))
        a0 = fma_f32(a0, cvt_f32(s0), load_f16(w, o) * dx)
        a1 = fma_f32(a1, cvt_f32(s1), load_f16(w, o + rb) * dx)
        # the min terms, - dmin * d_x * sum_g min_g * bsum_g, into the same float lanes (g)
        a0 = fma_f32(a0, cvt_f32(madd(mins_pairs_from_u64(mn0), bs)), -(load_f16(w, o + 2) * dx))
        a1 = fma_f32(a1, cvt_f32(madd(mins_pairs_from_u64(mn1), bs)), -(load_f16(w, o + rb + 2) * dx))
    return hsum_f32(a0), hsum_f32(a1)


@njit(inline="always")
def isum_q6_k_half(w, o, h, x0, x1, x2, x3, z0, z1, z2, z3):
    """Exact int32 lanes of sum scale * (q - 32) * q8 over elements 128h .. 128h + 127 of the q6_K block at o;
    z_k = maddubs_32(x_k): q stays unsigned (0..63) and 32 x is subtracted after the byte products, as ggml."""
    ql0, ql1 = load_i8x32(w, o + 64 * h), load_i8x32(w, o + 64 * h + 32)
    qh = load_i8x32(w, o + 128 + 32 * h)
    sv = scales_i8x8(w, o + 192 + 8 * h)  # int8 scales of sub-blocks 8h..8h+7, shuffled per group
    q = or_i8(and_i8(ql0, 15), shl_i8(and_i8(qh, 3), 4))
    acc = madd(sub_i16(maddubs(q, x0), z0), shuffle_scales(sv, K6_SCALE_SHUF, 0))
    q = or_i8(and_i8(ql1, 15), shl_i8(and_i8(shr_i8(qh, 2), 3), 4))
    acc = add_i32(acc, madd(sub_i16(maddubs(q, x1), z1), shuffle_scales(sv, K6_SCALE_SHUF, 1)))
    q = or_i8(shr_i8(ql0, 4), shl_i8(and_i8(shr_i8(qh, 4), 3), 4))
    acc = add_i32(acc, madd(sub_i16(maddubs(q, x2), z2), shuffle_scales(sv, K6_SCALE_SHUF, 2)))
    q = or_i8(shr_i8(ql1, 4), shl_i8(shr_i8(qh, 6), 4))
    return add_i32(acc, madd(sub_i16(maddubs(q, x3), z3), shuffle_scales(sv, K6_SCALE_SHUF, 3)))


@njit(inline="always")
def isum_q6_k_half_vnni(w, o, h, x0, x1, x2, x3, n0, n1, n2, n3):
    """isum_q6_k_half's int32 lanes, equal lane for lane, through vpdpbusd: n_k = -32 times the sums of 4
    activations of x_k (shared by the rows), so vpdpbusd of the unsigned codes from n_k leaves the exact
    sum of (q - 32) * q8 over codes 4j..4j+3 in lane j, as vpmaddubsw, the 32 x term and vpmaddwd's pairs did;
    each is then multiplied by its 16-element scale (vpmulld)."""
    ql0, ql1 = load_i8x32(w, o + 64 * h), load_i8x32(w, o + 64 * h + 32)
    qh = load_i8x32(w, o + 128 + 32 * h)
    so = o + 192 + 8 * h  # int8 scales of sub-blocks 8h..8h+7: group k takes 8h + 2k and 8h + 2k + 1
    q = or_i8(and_i8(ql0, 15), shl_i8(and_i8(qh, 3), 4))
    acc = mul_i32(dpbusd(n0, q, x0), scale_pair_i32(w, so))
    q = or_i8(and_i8(ql1, 15), shl_i8(and_i8(shr_i8(qh, 2), 3), 4))
    acc = add_i32(acc, mul_i32(dpbusd(n1, q, x1), scale_pair_i32(w, so + 2)))
    q = or_i8(shr_i8(ql0, 4), shl_i8(and_i8(shr_i8(qh, 4), 3), 4))
    acc = add_i32(acc, mul_i32(dpbusd(n2, q, x2), scale_pair_i32(w, so + 4)))
    q = or_i8(shr_i8(ql1, 4), shl_i8(shr_i8(qh, 6), 4))
    return add_i32(acc, mul_i32(dpbusd(n3, q, x3), scale_pair_i32(w, so + 6)))


@njit(inline="always")
def neg32_sums(x):
    """-32 times the sums of each 4 activations of x, int32 lanes (isum_q6_k_half_vnni's start)."""
    return sub_i32(zero_i32(), dpbusd(zero_i32(), splat_i8(32), x))


@njit(cache=True, fastmath=True)
def dot2_q6_k(w, wo, rb, xq, xd, bsums, nb):
    a0, a1 = zero_f32(), zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for i in range(nb):
        o, xb, dx = wo + i * 210, i * QK_K, xd[i]
        s0, s1 = zero_i32(), zero_i32()
        for h in range(2):
            for k in range(4):
                prefetch(w, wo + 2 * i * 210 + pf + 256 * h + 64 * k)
            x0, x1 = load_i8x32(xq, xb + 128 * h), load_i8x32(xq, xb + 128 * h + 32)
            x2, x3 = load_i8x32(xq, xb + 128 * h + 64), load_i8x32(xq, xb + 128 * h + 96)
            if has_vnni():  # the same int32 lanes through vpdpbusd (a compile-time branch)
                n0, n1, n2, n3 = neg32_sums(x0), neg32_sums(x1), neg32_sums(x2), neg32_sums(x3)  # both rows'
                s0 = add_i32(s0, isum_q6_k_half_vnni(w, o, h, x0, x1, x2, x3, n0, n1, n2, n3))
                s1 = add_i32(s1, isum_q6_k_half_vnni(w, o + rb, h, x0, x1, x2, x3, n0, n1, n2, n3))
            else:
                z0, z1, z2, z3 = maddubs_32(x0), maddubs_32(x1), maddubs_32(x2), maddubs_32(x3)  # both rows'
                s0 = add_i32(s0, isum_q6_k_half(w, o, h, x0, x1, x2, x3, z0, z1, z2, z3))
                s1 = add_i32(s1, isum_q6_k_half(w, o + rb, h, x0, x1, x2, x3, z0, z1, z2, z3))
        a0 = fma_f32(a0, cvt_f32(s0), load_f16(w, o + 208) * dx)
        a1 = fma_f32(a1, cvt_f32(s1), load_f16(w, o + rb + 208) * dx)
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def dot2_iq4_xs(w, wo, rb, xq, xd, bsums, nb):
    a0, a1 = zero_f32(), zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for i in range(nb):
        o, xb, dx = wo + i * 136, i * QK_K, xd[i]
        for line in range(0, 272, 64):  # the pair's 272 bytes
            prefetch(w, wo + 2 * i * 136 + pf + line)
        h0, h1 = load_u32(w, o), load_u32(w, o + rb)  # d | scales_h << 16
        l0, l1 = load_u32(w, o + 4), load_u32(w, o + rb + 4)  # scales_l: a nibble per sub-block
        s0, s1 = zero_i32(), zero_i32()
        for g in range(8):
            x = load_i8x32(xq, xb + 32 * g)
            q = codes_iq4_xs(w, o, g)
            ls = (((l0 >> (4 * g)) & 15) | (((h0 >> (16 + 2 * g)) & 3) << 4)) - 32
            s0 = add_i32(s0, madd(maddubs(abs_i8(q), sign_i8(x, q)), splat_i16(ls)))
            q = codes_iq4_xs(w, o + rb, g)
            ls = (((l1 >> (4 * g)) & 15) | (((h1 >> (16 + 2 * g)) & 3) << 4)) - 32
            s1 = add_i32(s1, madd(maddubs(abs_i8(q), sign_i8(x, q)), splat_i16(ls)))
        a0 = fma_f32(a0, cvt_f32(s0), load_f16(w, o + 0) * dx)
        a1 = fma_f32(a1, cvt_f32(s1), load_f16(w, o + rb + 0) * dx)
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def rows_dot(kind, w, row_bytes, r0, r1, xq, xd, bsums, y, nb):
    """y[r] = row r . one token for r0 <= r < r1, two rows at a time (an odd last row goes twice);
    w the flat weight bytes, xq/xd/bsums/y the token's rows. One loop per type: each inlines its own dot2."""
    if kind == Q4_K_X8:  # r0, r1: multiples of 8
        for r in range(r0, r1, 8):
            q4_k_x8.dot8_q4_k_x8(w, r * row_bytes, xq, xd, bsums, nb, y, r)
    elif kind == IQ4_XS_X8:
        for r in range(r0, r1, 8):
            iq4_xs_x8.dot8_iq4_xs_x8(w, r * row_bytes, xq, xd, nb, y, r)
    elif kind == Q4_K:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q4_k(w, r * row_bytes, rb, xq, xd, bsums, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind == Q6_K:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q6_k(w, r * row_bytes, rb, xq, xd, bsums, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind == Q5_K:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q5_k(w, r * row_bytes, rb, xq, xd, bsums, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind == Q2_K:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q2_k(w, r * row_bytes, rb, xq, xd, bsums, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind == Q3_K:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q3_k(w, r * row_bytes, rb, xq, xd, bsums, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind >= vec_dot_iq.FIRST_KIND:
        vec_dot_iq.rows_dot(kind, w, row_bytes, r0, r1, xq, xd, bsums, y, nb)
    else:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_iq4_xs(w, r * row_bytes, rb, xq, xd, bsums, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1


@njit(cache=True, parallel=True, fastmath=True)
def matmul_q8_k_act(w0, w1, w2, k0, k1, k2, xq, xd, bsums, y0, y1, y2, rows_per_task, rows_per_block, n_threads, counter):
    """y_m[t, r] = row r of w_m . token t for up to three weights times the same tokens (q/k/v, gate/up), for n_tok
    small enough that integer dots beat the float GEMM; an unused slot is a weight of 0 rows.

    w_m: uint8 (n_out_m, row_bytes_m) raw super-blocks of type k_m; xq/xd/bsums: Q8_K activations (module
    docstring); y_m: float32 (n_tok, n_out_m); n_threads: numba.get_num_threads(); counter:
    kernels_cpu.sched.new_counter(). Tasks of `rows_per_task`
    contiguous rows, first all of w0's, then w1's, then w2's, are claimed one at a time by the threads (one parallel
    region serves all three); a task runs its rows in blocks of `rows_per_block`, which stay in L1 while every
    token passes.
    """
    n_tok, n_in = xq.shape
    nb = n_in // QK_K
    t0 = (w0.shape[0] + rows_per_task - 1) // rows_per_task
    t1 = (w1.shape[0] + rows_per_task - 1) // rows_per_task
    n_tasks = t0 + t1 + (w2.shape[0] + rows_per_task - 1) // rows_per_task
    f0, f1, f2 = w0.reshape(w0.size), w1.reshape(w1.size), w2.reshape(w2.size)  # linear byte offsets
    xq_f, xd_f, bs_f = xq.reshape(xq.size), xd.reshape(xd.size), bsums.reshape(bsums.size)
    for _ in prange(max(1, min(n_threads, n_tasks))):  # one claimer a thread
        task = next_task(counter)
        while task < n_tasks:
            if task < t0:
                w, kind, y, r0 = f0, k0, y0, task * rows_per_task
                n_out, row_bytes = w0.shape
            elif task < t0 + t1:
                w, kind, y, r0 = f1, k1, y1, (task - t0) * rows_per_task
                n_out, row_bytes = w1.shape
            else:
                w, kind, y, r0 = f2, k2, y2, (task - t0 - t1) * rows_per_task
                n_out, row_bytes = w2.shape
            r1 = min(n_out, r0 + rows_per_task)
            four = n_tok > 1 and (kind == Q4_K_X8 or kind == Q6_K)  # the types of k_tokens.rows_dot4
            y_f = y.reshape(y.size)
            for b0 in range(r0, r1, rows_per_block):  # blocks of rows stay in L1 while every token passes
                b1 = min(r1, b0 + rows_per_block)
                t = 0
                if four:  # 4 tokens a pass over the block (a last 3 repeat their last token; a last 2: 2-token dots)
                    for t in range(0, n_tok - 1, 4):
                        k_tokens.rows_dot4(kind == Q4_K_X8, w, row_bytes, b0, b1, xq_f, xd_f, bs_f, t, t + 1,
                                           min(t + 2, n_tok - 1), min(t + 3, n_tok - 1), y_f, n_out, nb)
                    t = n_tok - n_tok % 4 if n_tok % 4 == 1 else n_tok
                for t in range(t, n_tok):
                    rows_dot(kind, w, row_bytes, b0, b1, xq[t], xd[t], bsums[t], y[t], nb)
            task = next_task(counter)


# -- float32 decoding of a row (for the batched GEMM) ---------------------------------------------------------
@njit(cache=True, fastmath=True)
def decode_row_f32(kind, w, wo, nb, out, oo):
    """Row of `kind` at byte wo (nb super-blocks) -> float32 out[oo:oo + 256 nb] (ggml's dequantize)."""
    if kind == Q4_K_X8:
        q4_k_x8.decode_row_f32(w, wo, nb, out, oo)
        return
    if kind == IQ4_XS_X8:  # the row's original blocks, then their decoder
        row = np.empty(nb * 136, dtype=np.uint8)
        iq4_xs_x8.unpack_row(w, wo, nb, row)
        for i in range(nb):
            _decode_iq4_xs(row, i * 136, out, oo + i * QK_K)
        return
    if kind >= vec_dot_iq.FIRST_KIND:
        vec_dot_iq.decode_row_f32(kind, w, wo, nb, out, oo)
        return
    for i in range(nb):
        ob = oo + i * QK_K
        if kind == Q4_K or kind == Q5_K:
            o = wo + i * (144 if kind == Q4_K else 176)
            d, dmin = load_f16(w, o), load_f16(w, o + 2)
            for g in range(8):
                sc, m = scale_min_k4(w, o, g)
                q = codes_q4_k(w, o, g) if kind == Q4_K else codes_q5_k(w, o, g)
                a, b = d * np.float32(sc), -(dmin * np.float32(m))
                store_scaled(out, ob + 32 * g, q, a, b, a, b)
        elif kind == Q2_K:
            o = wo + i * 84
            d, dmin = load_f16(w, o + 80), load_f16(w, o + 82)
            for g in range(8):
                s0, s1 = np.int32(w[o + 2 * g]), np.int32(w[o + 2 * g + 1])
                store_scaled(out, ob + 32 * g, codes_q2_k(w, o, g), d * np.float32(s0 & 15),
                             -(dmin * np.float32(s0 >> 4)), d * np.float32(s1 & 15), -(dmin * np.float32(s1 >> 4)))
        elif kind == Q3_K:
            o = wo + i * 110
            d = load_f16(w, o + 108)
            for g in range(8):
                store_scaled(out, ob + 32 * g, codes_q3_k(w, o, g), d * np.float32(scale_q3_k(w, o, 2 * g)),
                             np.float32(0.0), d * np.float32(scale_q3_k(w, o, 2 * g + 1)), np.float32(0.0))
        elif kind == Q6_K:
            o = wo + i * 210
            d = load_f16(w, o + 208)
            for g in range(8):
                store_scaled(out, ob + 32 * g, codes_q6_k(w, o, g), d * np.float32(scale_q6_k(w, o, 2 * g)),
                             np.float32(0.0), d * np.float32(scale_q6_k(w, o, 2 * g + 1)), np.float32(0.0))
        else:
            _decode_iq4_xs(w, wo + i * 136, out, ob)


@njit(inline="always", fastmath=True)
def _decode_iq4_xs(w, o, out, ob):
    """The block_iq4_xs at byte o -> float32 out[ob:ob + 256]."""
    d = load_f16(w, o)
    for g in range(8):
        a = d * np.float32(scale_iq4_xs(w, o, g))
        store_scaled(out, ob + 32 * g, codes_iq4_xs(w, o, g), a, np.float32(0.0), a, np.float32(0.0))
