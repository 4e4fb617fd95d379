"""Q4_K rows interleaved by 8 (as llama.cpp's CPU "repack" buffers, in a layout of our own): the weights the CPU
keeps are copied once at load into groups of 8 rows, so that one activation broadcast, one scale load and one
vpmaddubsw serve 4 rows at a time and the scales are unpacked once, at load, instead of on every token.

Layout: rows 8G..8G + 7 form group G, nb super-blocks each of 1184 bytes (= 8 x 148: still 148 bytes per row
and block, against Q4_K's 144), block i of group G at byte (G * nb + i) * 1184:

    0     d[8]            fp16, row r's d
    16    dmin[8]         fp16
    32    scales[8][8]    uint8, [sub-block g][row r]: the 6-bit scale
    96    mins[4][8][2]   uint8, [k][row r][e]: the 6-bit min of sub-block 2k + e
    160   qs[16][8][8]    [chunk c][row r]: bytes 8c..8c + 7 of row r's qs (low nibbles: elements
                          64 (c // 4) + 8 (c % 4) + 0..7; high nibbles: the same + 32)

The array keeps the matrix shape (n_out, nb * 148), so row counts and byte counts read as before; a row's bytes
are spread over its group. Products are ggml's arithmetic (exact int32 sums of scale * q * q8 per super-block,
mins from the Q8_K block sums, then d * d_x and dmin * d_x in float32); only the float32 summation order differs
from the plain Q4_K dot. dot8x4_q4_k_x8 / dot8x2_q4_k_x8: the same 8 rows times 4 or 2 tokens, a super-block's
codes unpacked once for all of them (with VNNI the sub-block sums of vpdpbusd times the scale: the same int32 lanes).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels_cpu import x8_layout
from kernels_cpu.simd import (cvt_f32, fmav_f32, load_f16, load_f16x8, load_i8x32, prefetch, store_f32x8,
                              store_scaled, zero_f32)
from kernels_cpu.simd_int import add_i16, add_i32, and_i8, madd, maddubs, shr_i8, zero_i32
from kernels_cpu.simd_x8 import (bcast_i8x8, bsum_pair, dpbusd, dup_hi_f32, dup_lo_f32, gather_i8x8x4, has_vnni,
                                 load_u8x16, mul_i32, pairsum_sub_f32, scale_f32, scales4_u8, scales4x2_i8)

QK_K = 256
ROWS = 8  # rows per group
BLOCK_BYTES = 1184  # one super-block of 8 rows
ROW_BLOCK_BYTES = BLOCK_BYTES // ROWS  # 148: what one row's block takes
# software prefetch this far ahead in the group's stream, every line: measured on one Zen 3 core over a 56 MB
# matrix, 1 KB ahead read 16 GB/s, 2-8 KB 19-20, no prefetch 13 (the plain Q4_K dot: 13)
PREFETCH_BYTES = 4096
# The dots' float flags: fastmath without reassociation. With it, LLVM split dot8_q4_k_x8's float accumulators over
# the super-block loop in an order of its own (the sums moved by an ulp), which dot8x4_q4_k_x8's larger loop body
# did not follow; without it both sum in the order written, so a token's outputs are the same in a batch of 4.
FAST = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}


def repackable(shape: tuple[int, ...]) -> bool:
    """Whether a Q4_K matrix of numpy shape (n_out, n_in) can be interleaved: whole groups of 8 rows."""
    return x8_layout.repackable(shape, QK_K)


def repack(raw: np.ndarray) -> np.ndarray:
    """Q4_K rows uint8 (n_out, nb * 144) -> the interleaved layout, uint8 (n_out, nb * 148); groups in parallel."""
    return x8_layout.interleave(raw, "a Q4_K", QK_K, 144, ROW_BLOCK_BYTES, _repack_groups)


@njit(inline="always")
def scale_min_k4(w, o, j):
    """get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) of the q4_K/q5_K block at byte o."""
    if j < 4:
        return np.int32(w[o + 4 + j]) & 63, np.int32(w[o + 8 + j]) & 63
    a, b, c = np.int32(w[o + j]), np.int32(w[o + 4 + j]), np.int32(w[o + 8 + j])
    return (c & 0xF) | ((a >> 6) << 4), (c >> 4) | ((b >> 6) << 4)


@njit(cache=True, parallel=True)
def _repack_groups(src, nb, dst):
    rb = nb * 144
    for g in prange(src.size // (ROWS * rb)):
        for i in range(nb):
            o = (g * nb + i) * BLOCK_BYTES
            for r in range(ROWS):
                s = (g * ROWS + r) * rb + i * 144
                dst[o + 2 * r], dst[o + 2 * r + 1] = src[s], src[s + 1]  # d
                dst[o + 16 + 2 * r], dst[o + 17 + 2 * r] = src[s + 2], src[s + 3]  # dmin
                for j in range(8):
                    sc, m = scale_min_k4(src, s, j)
                    dst[o + 32 + 8 * j + r] = sc
                    dst[o + 96 + 16 * (j // 2) + 2 * r + j % 2] = m
                for c in range(16):
                    for e in range(8):
                        dst[o + 160 + 64 * c + 8 * r + e] = src[s + 16 + 8 * c + e]


@njit(cache=True, fastmath=FAST)
def dot8_q4_k_x8(w, go, xq, xd, bsums, nb, y, r0):
    """y[r0:r0 + 8] = the 8 rows of the group at byte go . one token's Q8_K activations (xq, xd, bsums). With VNNI
    through the 4-token kernel's steps for one token (_isum4: vpdpbusd, the same int32 lanes; the same float work),
    else vpmaddubsw's int16 sums here: the same outputs bit for bit."""
    if has_vnni():
        _dot8_tokens(w, go, xq, xd, bsums, 0, 0, 0, 0, nb, y, 0, r0, 1)
        return
    f_lo, f_hi, f_min = zero_f32(), zero_f32(), zero_f32()
    for i in range(nb):
        o, xb, dx = go + i * BLOCK_BYTES, i * QK_K, xd[i]
        a_lo, a_hi = zero_i32(), zero_i32()
        for j in range(4):  # sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles): chunks 4j..4j + 3
            qo = o + 160 + 256 * j
            for line in range(4):
                prefetch(w, qo + PREFETCH_BYTES + 64 * line)
            xl, xh = bcast_i8x8(xq, xb + 64 * j), bcast_i8x8(xq, xb + 64 * j + 32)
            q = load_i8x32(w, qo)
            l_lo, h_lo = maddubs(and_i8(q, 15), xl), maddubs(shr_i8(q, 4), xh)
            q = load_i8x32(w, qo + 32)
            l_hi, h_hi = maddubs(and_i8(q, 15), xl), maddubs(shr_i8(q, 4), xh)
            for c in range(1, 4):  # int16 sums of a sub-block: |4 * 2 * 15 * 127| < 2**15
                xl, xh = bcast_i8x8(xq, xb + 64 * j + 8 * c), bcast_i8x8(xq, xb + 64 * j + 32 + 8 * c)
                q = load_i8x32(w, qo + 64 * c)
                l_lo, h_lo = add_i16(l_lo, maddubs(and_i8(q, 15), xl)), add_i16(h_lo, maddubs(shr_i8(q, 4), xh))
                q = load_i8x32(w, qo + 64 * c + 32)
                l_hi, h_hi = add_i16(l_hi, maddubs(and_i8(q, 15), xl)), add_i16(h_hi, maddubs(shr_i8(q, 4), xh))
            so = o + 32 + 16 * j  # scales of sub-block 2j: rows 0-3, rows 4-7; sub-block 2j + 1 at + 8
            a_lo = add_i32(a_lo, add_i32(madd(l_lo, scales4_u8(w, so)), madd(h_lo, scales4_u8(w, so + 8))))
            a_hi = add_i32(a_hi, add_i32(madd(l_hi, scales4_u8(w, so + 4)), madd(h_hi, scales4_u8(w, so + 12))))
        # sum_g min_g * bsum_g, one int32 lane per row
        m = add_i32(madd(load_u8x16(w, o + 96), bsum_pair(bsums, 16 * i)),
                    madd(load_u8x16(w, o + 112), bsum_pair(bsums, 16 * i + 4)))
        m = add_i32(m, add_i32(madd(load_u8x16(w, o + 128), bsum_pair(bsums, 16 * i + 8)),
                               madd(load_u8x16(w, o + 144), bsum_pair(bsums, 16 * i + 12))))
        d8 = scale_f32(load_f16x8(w, o), dx)
        f_lo = fmav_f32(f_lo, cvt_f32(a_lo), dup_lo_f32(d8))
        f_hi = fmav_f32(f_hi, cvt_f32(a_hi), dup_hi_f32(d8))
        f_min = fmav_f32(f_min, cvt_f32(m), scale_f32(load_f16x8(w, o + 16), dx))
    store_f32x8(y, r0, pairsum_sub_f32(f_lo, f_hi, f_min))


# -- 8 rows . 4 tokens: a super-block's codes unpacked once for all the tokens -----------------------------------
@njit(inline="always")
def _isum4(w, so, c, xq, xo):
    """One token's int32 lanes (2 per row; rows 0-3, rows 4-7) of sum scale * q * q8 over sub-blocks 2j, 2j + 1,
    c: the 16 code vectors of chunks 0-3 (per chunk: rows 0-3 low, high nibbles, rows 4-7 low, high), so: the
    scales at byte so, xo: the token's 64 activations. The same exact sums as dot8_q4_k_x8's: with VNNI the
    sub-block sums of vpdpbusd times the scale, else its int16 sums through vpmaddwd."""
    xl, xh = bcast_i8x8(xq, xo), bcast_i8x8(xq, xo + 32)
    if has_vnni():
        l_lo, h_lo = dpbusd(zero_i32(), c[0], xl), dpbusd(zero_i32(), c[1], xh)
        l_hi, h_hi = dpbusd(zero_i32(), c[2], xl), dpbusd(zero_i32(), c[3], xh)
        for k in range(1, 4):
            xl, xh = bcast_i8x8(xq, xo + 8 * k), bcast_i8x8(xq, xo + 32 + 8 * k)
            l_lo, h_lo = dpbusd(l_lo, c[4 * k], xl), dpbusd(h_lo, c[4 * k + 1], xh)
            l_hi, h_hi = dpbusd(l_hi, c[4 * k + 2], xl), dpbusd(h_hi, c[4 * k + 3], xh)
        a_lo = add_i32(mul_i32(l_lo, scales4x2_i8(w, so)), mul_i32(h_lo, scales4x2_i8(w, so + 8)))
        a_hi = add_i32(mul_i32(l_hi, scales4x2_i8(w, so + 4)), mul_i32(h_hi, scales4x2_i8(w, so + 12)))
        return a_lo, a_hi
    m_lo, n_lo = maddubs(c[0], xl), maddubs(c[1], xh)
    m_hi, n_hi = maddubs(c[2], xl), maddubs(c[3], xh)
    for k in range(1, 4):  # int16 sums of a sub-block: |4 * 2 * 15 * 127| < 2**15
        xl, xh = bcast_i8x8(xq, xo + 8 * k), bcast_i8x8(xq, xo + 32 + 8 * k)
        m_lo, n_lo = add_i16(m_lo, maddubs(c[4 * k], xl)), add_i16(n_lo, maddubs(c[4 * k + 1], xh))
        m_hi, n_hi = add_i16(m_hi, maddubs(c[4 * k + 2], xl)), add_i16(n_hi, maddubs(c[4 * k + 3], xh))
    return (add_i32(madd(m_lo, scales4_u8(w, so)), madd(n_lo, scales4_u8(w, so + 8))),
            add_i32(madd(m_hi, scales4_u8(w, so + 4)), madd(n_hi, scales4_u8(w, so + 12))))


@njit(inline="always")
def _chunks(w, qo):
    """The 16 code vectors of chunks 0-3 at qo: per chunk rows 0-3 low, high nibbles, rows 4-7 low, high."""
    q0, p0, q1, p1 = load_i8x32(w, qo), load_i8x32(w, qo + 32), load_i8x32(w, qo + 64), load_i8x32(w, qo + 96)
    q2, p2, q3, p3 = (load_i8x32(w, qo + 128), load_i8x32(w, qo + 160), load_i8x32(w, qo + 192),
                      load_i8x32(w, qo + 224))
    return (and_i8(q0, 15), shr_i8(q0, 4), and_i8(p0, 15), shr_i8(p0, 4),
            and_i8(q1, 15), shr_i8(q1, 4), and_i8(p1, 15), shr_i8(p1, 4),
            and_i8(q2, 15), shr_i8(q2, 4), and_i8(p2, 15), shr_i8(p2, 4),
            and_i8(q3, 15), shr_i8(q3, 4), and_i8(p3, 15), shr_i8(p3, 4))


@njit(inline="always", fastmath=FAST)
def _finish4(f_lo, f_hi, f_min, a_lo, a_hi, w, o, bsums, bo, dx):
    """One token's float work of a super-block, as dot8_q4_k_x8's (the mins from its block sums at bo)."""
    m = add_i32(madd(load_u8x16(w, o + 96), bsum_pair(bsums, bo)),
                madd(load_u8x16(w, o + 112), bsum_pair(bsums, bo + 4)))
    m = add_i32(m, add_i32(madd(load_u8x16(w, o + 128), bsum_pair(bsums, bo + 8)),
                           madd(load_u8x16(w, o + 144), bsum_pair(bsums, bo + 12))))
    d8 = scale_f32(load_f16x8(w, o), dx)
    return (fmav_f32(f_lo, cvt_f32(a_lo), dup_lo_f32(d8)), fmav_f32(f_hi, cvt_f32(a_hi), dup_hi_f32(d8)),
            fmav_f32(f_min, cvt_f32(m), scale_f32(load_f16x8(w, o + 16), dx)))


@njit(inline="always", fastmath=FAST)
def _dot8_tokens(w, go, xq, xd, bsums, t0, t1, t2, t3, nb, y, n_out, r0, nt):
    """The 8 rows of the group at byte go . the first nt (1, 2 or 4) of the tokens t0..t3 (a literal at each
    call, so the branches fold away)."""
    n_in = nb * QK_K
    l0, h0, m0, l1, h1, m1 = zero_f32(), zero_f32(), zero_f32(), zero_f32(), zero_f32(), zero_f32()
    l2, h2, m2, l3, h3, m3 = zero_f32(), zero_f32(), zero_f32(), zero_f32(), zero_f32(), zero_f32()
    for i in range(nb):
        o, xb = go + i * BLOCK_BYTES, i * QK_K
        b0, b1, b2, b3 = zero_i32(), zero_i32(), zero_i32(), zero_i32()
        c0, c1, c2, c3 = zero_i32(), zero_i32(), zero_i32(), zero_i32()
        for j in range(4):
            qo = o + 160 + 256 * j
            for line in range(4):
                prefetch(w, qo + PREFETCH_BYTES + 64 * line)
            c = _chunks(w, qo)
            so = o + 32 + 16 * j
            v, u = _isum4(w, so, c, xq, t0 * n_in + xb + 64 * j)
            b0, c0 = add_i32(b0, v), add_i32(c0, u)
            if nt >= 2:
                v, u = _isum4(w, so, c, xq, t1 * n_in + xb + 64 * j)
                b1, c1 = add_i32(b1, v), add_i32(c1, u)
            if nt == 4:
                v, u = _isum4(w, so, c, xq, t2 * n_in + xb + 64 * j)
                b2, c2 = add_i32(b2, v), add_i32(c2, u)
                v, u = _isum4(w, so, c, xq, t3 * n_in + xb + 64 * j)
                b3, c3 = add_i32(b3, v), add_i32(c3, u)
        k = n_in // 16
        l0, h0, m0 = _finish4(l0, h0, m0, b0, c0, w, o, bsums, t0 * k + 16 * i, xd[t0 * nb + i])
        if nt >= 2:
            l1, h1, m1 = _finish4(l1, h1, m1, b1, c1, w, o, bsums, t1 * k + 16 * i, xd[t1 * nb + i])
        if nt == 4:
            l2, h2, m2 = _finish4(l2, h2, m2, b2, c2, w, o, bsums, t2 * k + 16 * i, xd[t2 * nb + i])
            l3, h3, m3 = _finish4(l3, h3, m3, b3, c3, w, o, bsums, t3 * k + 16 * i, xd[t3 * nb + i])
    store_f32x8(y, t0 * n_out + r0, pairsum_sub_f32(l0, h0, m0))
    if nt >= 2:
        store_f32x8(y, t1 * n_out + r0, pairsum_sub_f32(l1, h1, m1))
    if nt == 4:
        store_f32x8(y, t2 * n_out + r0, pairsum_sub_f32(l2, h2, m2))
        store_f32x8(y, t3 * n_out + r0, pairsum_sub_f32(l3, h3, m3))


@njit(cache=True, fastmath=FAST)
def dot8x4_q4_k_x8(w, go, xq, xd, bsums, t0, t1, t2, t3, nb, y, n_out, r0):
    """y[t, r0:r0 + 8] (y flat, n_tok * n_out) = the 8 rows of the group at byte go . tokens t = t0..t3 of the flat
    Q8_K activations xq, xd, bsums (a repeated token is computed again); each equals dot8_q4_k_x8's."""
    _dot8_tokens(w, go, xq, xd, bsums, t0, t1, t2, t3, nb, y, n_out, r0, 4)


@njit(cache=True, fastmath=FAST)
def dot8x2_q4_k_x8(w, go, xq, xd, bsums, t0, t1, nb, y, n_out, r0):
    """dot8x4_q4_k_x8 for two tokens t0, t1."""
    _dot8_tokens(w, go, xq, xd, bsums, t0, t1, t1, t1, nb, y, n_out, r0, 2)


@njit(cache=True, fastmath=True)
def decode_row_f32(w, wo, nb, out, oo):
    """Row at byte wo (nb super-blocks of 148 bytes; the row's offset in the plain shape) -> float32
    out[oo:oo + 256 nb]: ggml's dequantize of the original Q4_K row, the same floats as vec_dot_k's."""
    rb = nb * ROW_BLOCK_BYTES
    r = wo // rb
    s = r % ROWS
    go = (r - s) * rb  # the group's first byte
    for i in range(nb):
        o, ob = go + i * BLOCK_BYTES, oo + i * QK_K
        d, dmin = load_f16(w, o + 2 * s), load_f16(w, o + 16 + 2 * s)
        for j in range(4):  # sub-blocks 2j and 2j + 1: the low and high nibbles of the same 32 bytes
            q = gather_i8x8x4(w, o + 160 + 256 * j + 8 * s, 64)
            a0, b0 = d * np.float32(w[o + 32 + 16 * j + s]), -(dmin * np.float32(w[o + 96 + 16 * j + 2 * s]))
            a1, b1 = d * np.float32(w[o + 40 + 16 * j + s]), -(dmin * np.float32(w[o + 97 + 16 * j + 2 * s]))
            store_scaled(out, ob + 64 * j, and_i8(q, 15), a0, b0, a0, b0)
            store_scaled(out, ob + 64 * j + 32, shr_i8(q, 4), a1, b1, a1, b1)
