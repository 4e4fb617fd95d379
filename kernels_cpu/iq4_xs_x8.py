"""IQ4_XS rows interleaved by 8 (kernels_cpu.q4_k_x8's arrangement of the codes): copied once at load into groups
of 8 rows, so that one activation broadcast and one scale load serve 4 rows, the 6-bit scales are unpacked once,
at load, instead of on every token, and a super-block's float work serves 8 rows.

Layout: rows 8G..8G + 7 form group G, nb super-blocks each of 1104 bytes (= 8 x 138: 138 bytes per row and block,
against IQ4_XS's 136), block i of group G at byte (G * nb + i) * 1104:

    0     d[8]            fp16, row r's d
    16    scales[8][8]    int8, [sub-block g][row r]: ls - 32 (-32..31)
    80    qs[16][8][8]    [chunk c][row r]: bytes 8c..8c + 7 of row r's qs (sub-block g = chunks 2g, 2g + 1; low
                          nibbles: elements 32g + 8 (c % 2) + 0..7, high nibbles: the same + 16)

The array keeps the matrix shape (n_out, nb * 138). Products are ggml's (ggml_vec_dot_iq4_xs_q8_K): the levels
kvalues_iq4nl[q] times q8 through |v| and sign(q8, v) (vpmaddubsw), by the sub-block's scale (vpmaddwd) into an
exact int32 sum per super-block, times d * d_x in float32; only the float32 summation order differs from
vec_dot_k.dot2_iq4_xs.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels_cpu import x8_layout
from kernels_cpu.simd import cvt_f32, fmav_f32, load_f16x8, load_i8x32, prefetch, store_f32x8, zero_f32
from kernels_cpu.simd_int import abs_i8, add_i32, and_i8, lut16_i8, madd, maddubs, shr_i8, sign_i8, splat_i8, zero_i32
from kernels_cpu.simd_x8 import (bcast_i8x8, dpbusd, dup_hi_f32, dup_lo_f32, has_vnni, mul_i32, pairsum_sub_f32,
                                 scale_f32, scales4_i8, scales4x2_i8, sub_i32)

QK_K = 256
ROWS = 8
ROW_BLOCK = 136  # block_iq4_xs: d (fp16), scales_h (u16), scales_l[4], qs[128]
BLOCK_BYTES = 1104  # one super-block of 8 rows
ROW_BLOCK_BYTES = BLOCK_BYTES // ROWS  # 138
PREFETCH_BYTES = 4096
# kvalues_iq4nl (ggml-common.h), as bytes for the lookup
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   dtype=np.int8).view(np.uint8)
# With VNNI the levels go in shifted to unsigned, v + 128 (1..241), for vpdpbusd (no int16 stage to saturate); the
# shift's product with the activations, 128 * sum q8 the same for every row, is taken off per sub-block.
KVALUES_U = (KVALUES.view(np.int8).astype(np.int32) + 128).astype(np.uint8)


def repackable(shape: tuple[int, ...]) -> bool:
    """Whether an IQ4_XS matrix of numpy shape (n_out, n_in) can be interleaved: whole groups of 8 rows."""
    return x8_layout.repackable(shape, QK_K)


def repack(raw: np.ndarray) -> np.ndarray:
    """IQ4_XS rows uint8 (n_out, nb * 136) -> the interleaved layout, uint8 (n_out, nb * 138); groups in parallel."""
    return x8_layout.interleave(raw, "an IQ4_XS", QK_K, ROW_BLOCK, ROW_BLOCK_BYTES, _repack_groups)


@njit(inline="always")
def scale_iq4_xs(w, o, ib):
    """The scale of sub-block ib (0..7) of the block_iq4_xs at byte o, minus 32 (ggml: ls - 32)."""
    scales_h = np.int32(w[o + 2]) | (np.int32(w[o + 3]) << 8)
    low = (np.int32(w[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF
    return (low | (((scales_h >> (2 * ib)) & 3) << 4)) - 32


@njit(cache=True, parallel=True)
def _repack_groups(src, nb, dst):
    rb = nb * ROW_BLOCK
    for g in prange(src.size // (ROWS * rb)):
        for i in range(nb):
            o = (g * nb + i) * BLOCK_BYTES
            for r in range(ROWS):
                s = (g * ROWS + r) * rb + i * ROW_BLOCK
                dst[o + 2 * r], dst[o + 2 * r + 1] = src[s], src[s + 1]  # d
                for j in range(8):
                    dst[o + 16 + 8 * j + r] = np.uint8(scale_iq4_xs(src, s, j) & 0xFF)  # int8 as a byte
                for c in range(16):
                    for e in range(8):
                        dst[o + 80 + 64 * c + 8 * r + e] = src[s + 8 + 8 * c + e]


@njit(inline="always")
def _sdot(q, x):
    """int16 lanes: pairs of kvalues[q] * x (|v| * sign(x, v), as ggml's mul_add_epi8; |pair| <= 2 * 127 * 127)."""
    v = lut16_i8(q, KVALUES, 0)
    return maddubs(abs_i8(v), sign_i8(x, v))


@njit(inline="always")
def _isum_vnni(q, p, x0, x1, x2, x3, z):
    """int32 lanes (2 per row) of sum v * q8 over a sub-block of 4 rows, codes q (chunk 2g), p (chunk 2g + 1), from
    the shifted levels (vpdpbusd) minus z = 128 * the activations' sums."""
    acc = dpbusd(zero_i32(), lut16_i8(and_i8(q, 15), KVALUES_U, 0), x0)
    acc = dpbusd(acc, lut16_i8(shr_i8(q, 4), KVALUES_U, 0), x2)
    acc = dpbusd(acc, lut16_i8(and_i8(p, 15), KVALUES_U, 0), x1)
    return sub_i32(dpbusd(acc, lut16_i8(shr_i8(p, 4), KVALUES_U, 0), x3), z)


@njit(cache=True, fastmath=True)
def dot8_iq4_xs_x8(w, go, xq, xd, nb, y, r0):
    """y[r0:r0 + 8] = the 8 IQ4_XS rows of the group at byte go . one token's Q8_K activations (xq, xd)."""
    f_lo, f_hi = zero_f32(), zero_f32()
    shift = splat_i8(128)
    for i in range(nb):
        o, xb = go + i * BLOCK_BYTES, i * QK_K
        a_lo, a_hi = zero_i32(), zero_i32()
        for g in range(8):  # sub-block g: chunks 2g (elements 0-7, 16-23) and 2g + 1 (8-15, 24-31)
            qo = o + 80 + 128 * g
            prefetch(w, qo + PREFETCH_BYTES)
            prefetch(w, qo + PREFETCH_BYTES + 64)
            x0, x1 = bcast_i8x8(xq, xb + 32 * g), bcast_i8x8(xq, xb + 32 * g + 8)
            x2, x3 = bcast_i8x8(xq, xb + 32 * g + 16), bcast_i8x8(xq, xb + 32 * g + 24)
            if has_vnni():  # the shift's products, the same for all rows: once per sub-block
                z = dpbusd(dpbusd(dpbusd(dpbusd(zero_i32(), shift, x0), shift, x1), shift, x2), shift, x3)
            for h in range(2):  # rows 4h..4h + 3
                q, p = load_i8x32(w, qo + 32 * h), load_i8x32(w, qo + 64 + 32 * h)
                if has_vnni():
                    s = mul_i32(_isum_vnni(q, p, x0, x1, x2, x3, z), scales4x2_i8(w, o + 16 + 8 * g + 4 * h))
                else:  # |v| and sign(q8, v) per code (ggml's AVX2 mul_add_epi8), the scale through vpmaddwd
                    sc = scales4_i8(w, o + 16 + 8 * g + 4 * h)
                    s = add_i32(madd(_sdot(and_i8(q, 15), x0), sc), madd(_sdot(shr_i8(q, 4), x2), sc))
                    s = add_i32(s, add_i32(madd(_sdot(and_i8(p, 15), x1), sc), madd(_sdot(shr_i8(p, 4), x3), sc)))
                if h == 0:
                    a_lo = add_i32(a_lo, s)
                else:
                    a_hi = add_i32(a_hi, s)
        d8 = scale_f32(load_f16x8(w, o), xd[i])
        f_lo = fmav_f32(f_lo, cvt_f32(a_lo), dup_lo_f32(d8))
        f_hi = fmav_f32(f_hi, cvt_f32(a_hi), dup_hi_f32(d8))
    store_f32x8(y, r0, pairsum_sub_f32(f_lo, f_hi, zero_f32()))


@njit(cache=True)
def unpack_row(w, wo, nb, out):
    """The original blocks of the row at byte wo (nb super-blocks of 138 bytes; the row's offset in the plain shape)
    -> out (nb * 136 bytes), for vec_dot_k's float decoder (the same floats as the plain row's)."""
    rb = nb * ROW_BLOCK_BYTES
    r = wo // rb
    s = r % ROWS
    go = (r - s) * rb  # the group's first byte
    for i in range(nb):
        o, ob = go + i * BLOCK_BYTES, i * ROW_BLOCK
        out[ob], out[ob + 1] = w[o + 2 * s], w[o + 2 * s + 1]
        scales_h = 0
        for j in range(4):
            out[ob + 4 + j] = 0
        for j in range(8):  # ls = scale + 32: low nibble into scales_l, high 2 bits into scales_h
            ls = (np.int32(w[o + 16 + 8 * j + s]) + 32) & 63
            out[ob + 4 + j // 2] |= np.uint8((ls & 15) << (4 * (j % 2)))
            scales_h |= (ls >> 4) << (2 * j)
        out[ob + 2], out[ob + 3] = scales_h & 0xFF, scales_h >> 8
        for c in range(16):
            for e in range(8):
                out[ob + 8 + 8 * c + e] = w[o + 80 + 64 * c + 8 * s + e]
