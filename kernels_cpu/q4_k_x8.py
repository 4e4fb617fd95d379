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
from the plain Q4_K dot.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels_cpu.simd import (cvt_f32, fmav_f32, load_f16, load_f16x8, load_i8x32, prefetch, store_f32x8,
                              store_scaled, zero_f32)
from kernels_cpu.simd_int import add_i16, add_i32, and_i8, madd, maddubs, shr_i8, zero_i32
from kernels_cpu.simd_x8 import (bcast_i8x8, bsum_pair, dup_hi_f32, dup_lo_f32, gather_i8x8x4, load_u8x16,
                                 pairsum_sub_f32, scale_f32, scales4_u8)

QK_K = 256
ROWS = 8  # rows per group
BLOCK_BYTES = 1184  # one super-block of 8 rows
ROW_BLOCK_BYTES = BLOCK_BYTES // ROWS  # 148: what one row's block takes
# software prefetch this far ahead in the group's stream, every line: measured on one Zen 3 core over a 56 MB
# matrix, 1 KB ahead read 16 GB/s, 2-8 KB 19-20, no prefetch 13 (the plain Q4_K dot: 13)
PREFETCH_BYTES = 4096


def repackable(shape: tuple[int, ...]) -> bool:
    """Whether a Q4_K matrix of numpy shape (n_out, n_in) can be interleaved: whole groups of 8 rows."""
    return len(shape) == 2 and shape[0] > 0 and shape[0] % ROWS == 0 and shape[1] % QK_K == 0


def repack(raw: np.ndarray) -> np.ndarray:
    """Q4_K rows uint8 (n_out, nb * 144) -> the interleaved layout, uint8 (n_out, nb * 148); groups in parallel."""
    n_out, rb = raw.shape
    nb = rb // 144
    if not repackable((n_out, nb * QK_K)) or rb != nb * 144:
        raise ValueError(f"cannot interleave a Q4_K matrix of {n_out} rows of {rb} bytes (8-row groups needed)")
    out = np.empty((n_out, nb * ROW_BLOCK_BYTES), dtype=np.uint8)
    _repack_groups(np.ascontiguousarray(raw).reshape(-1), nb, out.reshape(-1))
    return out


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


@njit(cache=True, fastmath=True)
def dot8_q4_k_x8(w, go, xq, xd, bsums, nb, y, r0):
    """y[r0:r0 + 8] = the 8 rows of the group at byte go . one token's Q8_K activations (xq, xd, bsums)."""
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
