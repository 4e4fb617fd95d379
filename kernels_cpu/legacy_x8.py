"""Q4_0 and Q5_0 rows interleaved by 8 (the 32-element types' counterpart of kernels_cpu.q4_k_x8): copied once
at load into groups of 8 rows, so one activation broadcast serves 4 rows, the offset (-8, -16) is taken off once
per block for all rows instead of through |q| and sign(x) per row, and the float work of a block serves 8 rows.

Layout: rows 8G..8G + 7 form group G, nb blocks of 8 rows each, block b of group G at byte (G * nb + b) * bytes:

    Q4_0 (144 bytes = 8 x 18)              Q5_0 (176 bytes = 8 x 22)
    0    d[8]           fp16               0    d[8]          fp16
                                           16   hb[32]        the 5th bits: bit v of byte 8i + e is that of
                                                              lane 8i + e of code vector v = 4c + 2 half + h
    16   qs[2][2][4][8] [chunk c][half]    48   qs[2][2][4][8]
         [row 4 half + i]: bytes 8c..8c + 7 of the row's qs (low nibbles: elements 8c + 0..7; high: 16 + 8c + 0..7)

The arrays keep the matrix shape (n_out, nb * 18 or 22). Products are ggml's: per block an exact int32 sum of
q * q8 with the offset applied, times d_w * d_x in float32; only the float32 summation order differs from
vec_dot_legacy's dot2 (2 lanes per row here, 8 there).
dot8x4_* / dot8x2_*: the same 8 rows times 4 or 2 tokens, a block's codes unpacked once for all of them (with
VNNI the sums go through vpdpbusd of the unsigned codes minus off * q8's, the same exact int32 lanes); with VNNI the
one-token dot8_* take that step for their one token too.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels_cpu import x8_layout
from kernels_cpu.simd import cvt_f32, fmav_f32, load_f16x8, load_i8x32, prefetch, store_f32x8, zero_f32
from kernels_cpu.simd_int import add_i16, and_i8, madd, maddubs, or_i8, shl_i8, shr_i8, splat_i8, splat_i16, zero_i32
from kernels_cpu.simd_k import sub_i16
from kernels_cpu.simd_x8 import (bcast_i8x8, dpbusd, dup_hi_f32, dup_lo_f32, has_vnni, pairsum_sub_f32, scale_f32,
                                 sub_i32)

QK = 32
ROWS = 8
BYTES = {"Q4_0": (18, 144), "Q5_0": (22, 176)}  # (a row's block, 8 rows' block)
PREFETCH_BYTES = 4096


def repackable(shape: tuple[int, ...]) -> bool:
    """Whether a matrix of numpy shape (n_out, n_in) can be interleaved: whole groups of 8 rows."""
    return x8_layout.repackable(shape, QK)


def _repack(raw: np.ndarray, name: str) -> np.ndarray:
    row_block, _ = BYTES[name]
    five = name == "Q5_0"
    return x8_layout.interleave(raw, f"a {name}", QK, row_block, row_block,
                                lambda src, nb, dst: _repack_groups(src, nb, five, dst))


@njit(cache=True, parallel=True)
def _repack_groups(src, nb, five, dst):
    row_block = 22 if five else 18
    rb, qs_at, qs_to = nb * row_block, 6 if five else 2, 8 * row_block - 128
    for g in prange(src.size // (ROWS * rb)):
        for b in range(nb):
            o = (g * nb + b) * 8 * row_block
            if five:
                dst[o + 16:o + 48] = 0
            for r in range(ROWS):
                s = (g * ROWS + r) * rb + b * row_block
                dst[o + 2 * r], dst[o + 2 * r + 1] = src[s], src[s + 1]  # d
                if five:  # the 5th bit of element j = 8c + e + 16h goes to bit 4c + 2 half + h of hb[8i + e]
                    for j in range(32):
                        c, e, h = (j // 8) % 2, j % 8, j // 16
                        bit = (src[s + 2 + j // 8] >> (j % 8)) & 1
                        dst[o + 16 + 8 * (r % 4) + e] |= bit << (4 * c + 2 * (r // 4) + h)
                for c in range(2):  # qs: [chunk][half][row in half][8]
                    for e in range(8):
                        dst[o + qs_to + 64 * c + 32 * (r // 4) + 8 * (r % 4) + e] = src[s + qs_at + 8 * c + e]


def repack_q4_0(raw: np.ndarray) -> np.ndarray:
    """Q4_0 rows uint8 (n_out, nb * 18) -> the interleaved layout (same shape)."""
    return _repack(raw, "Q4_0")


def repack_q5_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 rows uint8 (n_out, nb * 22) -> the interleaved layout (same shape)."""
    return _repack(raw, "Q5_0")


@njit(inline="always")
def _bit4(hb, v):
    """Bit v of every byte of hb moved to bit 4 (the 5th bit of a Q5_0 code)."""
    return and_i8(shl_i8(hb, 4 - v), 16) if v <= 4 else and_i8(shr_i8(hb, v - 4), 16)


@njit(inline="always")
def _half_sum(w, qo, hb, half, xl0, xl1, xh0, xh1, five):
    """int16 lanes (4 per row) of sum q * q8 over one block of 4 rows (rows 4 half ..): qs of chunk c at
    qo + 64 c, and for Q5_0 (five) the 5th bits from hb."""
    return _codes_sum(_codes(w, qo, hb, half, five), xl0, xl1, xh0, xh1)


@njit(inline="always")
def _codes_sum(c, xl0, xl1, xh0, xh1):
    """int16 lanes of sum q * q8 for the 4 code vectors c of _codes (|lane| <= 4 * 2 * 31 * 127 < 2**15)."""
    return add_i16(add_i16(maddubs(c[0], xl0), maddubs(c[1], xh0)), add_i16(maddubs(c[2], xl1), maddubs(c[3], xh1)))


@njit(inline="always")
def _dot8(w, go, xq, xd, nb, y, r0, five):
    if has_vnni():  # the 4-token kernel for one token: the same int32 lanes and float work
        _dot8x4(w, go, xq, xd, 0, 0, 0, 0, nb, y, 0, r0, five, 1)
        return
    step = 176 if five else 144
    off = splat_i8(16 if five else 8)
    ones = splat_i16(1)
    f_lo, f_hi = zero_f32(), zero_f32()
    for b in range(nb):
        o, xb = go + b * step, b * QK
        qo = o + step - 128
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o + PREFETCH_BYTES + 64)
        prefetch(w, o + PREFETCH_BYTES + 128)
        xl0, xl1 = bcast_i8x8(xq, xb), bcast_i8x8(xq, xb + 8)
        xh0, xh1 = bcast_i8x8(xq, xb + 16), bcast_i8x8(xq, xb + 24)
        # the offset times the activations, the same for every row: sum over the 4 runs of 8 of off * q8
        z = add_i16(add_i16(maddubs(off, xl0), maddubs(off, xh0)), add_i16(maddubs(off, xl1), maddubs(off, xh1)))
        hb = load_i8x32(w, o + 16)  # (Q5_0: the 5th bits; Q4_0: unused)
        s_lo = sub_i16(_half_sum(w, qo, hb, 0, xl0, xl1, xh0, xh1, five), z)
        s_hi = sub_i16(_half_sum(w, qo + 32, hb, 1, xl0, xl1, xh0, xh1, five), z)
        d8 = scale_f32(load_f16x8(w, o), xd[b])
        f_lo = fmav_f32(f_lo, cvt_f32(madd(s_lo, ones)), dup_lo_f32(d8))
        f_hi = fmav_f32(f_hi, cvt_f32(madd(s_hi, ones)), dup_hi_f32(d8))
    store_f32x8(y, r0, pairsum_sub_f32(f_lo, f_hi, zero_f32()))


@njit(cache=True, fastmath=True)
def dot8_q4_0_x8(w, go, xq, xd, nb, y, r0):
    """y[r0:r0 + 8] = the 8 Q4_0 rows of the group at byte go . one token's Q8_0 activations (xq, xd)."""
    _dot8(w, go, xq, xd, nb, y, r0, False)


@njit(cache=True, fastmath=True)
def dot8_q5_0_x8(w, go, xq, xd, nb, y, r0):
    """y[r0:r0 + 8] = the 8 Q5_0 rows of the group at byte go . one token's Q8_0 activations (xq, xd)."""
    _dot8(w, go, xq, xd, nb, y, r0, True)


# -- 8 rows . 4 tokens: a block's codes unpacked once for all the tokens ------------------------------------------
@njit(inline="always")
def _codes(w, qo, hb, half, five):
    """The 4 code vectors of _half_sum (chunk 0 low/high nibbles, chunk 1 low/high), unsigned."""
    q0, q1 = load_i8x32(w, qo), load_i8x32(w, qo + 64)
    lo0, hi0, lo1, hi1 = and_i8(q0, 15), shr_i8(q0, 4), and_i8(q1, 15), shr_i8(q1, 4)
    if five:
        lo0, hi0 = or_i8(lo0, _bit4(hb, 2 * half)), or_i8(hi0, _bit4(hb, 2 * half + 1))
        lo1, hi1 = or_i8(lo1, _bit4(hb, 4 + 2 * half)), or_i8(hi1, _bit4(hb, 5 + 2 * half))
    return lo0, hi0, lo1, hi1


@njit(inline="always", fastmath=True)
def _tok8(f_lo, f_hi, a, b, xq, xo, dx, h8, off):
    """One token's step of _dot8x4 over one block: a, b the unsigned codes of rows 0-3 and 4-7. The int32 lanes
    equal _dot8's (exact sums of (q - off) q8: with VNNI, vpdpbusd's sums of q q8 minus off q8's), then the same
    float work."""
    xl0, xl1 = bcast_i8x8(xq, xo), bcast_i8x8(xq, xo + 8)
    xh0, xh1 = bcast_i8x8(xq, xo + 16), bcast_i8x8(xq, xo + 24)
    if has_vnni():
        z = dpbusd(dpbusd(dpbusd(dpbusd(zero_i32(), off, xl0), off, xh0), off, xl1), off, xh1)
        i_lo = sub_i32(dpbusd(dpbusd(dpbusd(dpbusd(zero_i32(), a[0], xl0), a[1], xh0), a[2], xl1), a[3], xh1), z)
        i_hi = sub_i32(dpbusd(dpbusd(dpbusd(dpbusd(zero_i32(), b[0], xl0), b[1], xh0), b[2], xl1), b[3], xh1), z)
    else:
        ones = splat_i16(1)
        z = add_i16(add_i16(maddubs(off, xl0), maddubs(off, xh0)), add_i16(maddubs(off, xl1), maddubs(off, xh1)))
        s_lo, s_hi = _codes_sum(a, xl0, xl1, xh0, xh1), _codes_sum(b, xl0, xl1, xh0, xh1)
        i_lo, i_hi = madd(sub_i16(s_lo, z), ones), madd(sub_i16(s_hi, z), ones)
    d8 = scale_f32(h8, dx)
    return fmav_f32(f_lo, cvt_f32(i_lo), dup_lo_f32(d8)), fmav_f32(f_hi, cvt_f32(i_hi), dup_hi_f32(d8))


@njit(inline="always")
def _dot8x4(w, go, xq, xd, t0, t1, t2, t3, nb, y, n_out, r0, five, nt):
    """The 8 rows of the group at byte go . the first nt (1, 2 or 4) of the tokens t0..t3 (a literal at each
    call, so the branches fold away)."""
    step = 176 if five else 144
    off = splat_i8(16 if five else 8)
    n_in = nb * QK
    l0, h0, l1, h1, l2, h2, l3, h3 = (zero_f32(), zero_f32(), zero_f32(), zero_f32(), zero_f32(), zero_f32(),
                                      zero_f32(), zero_f32())
    for b in range(nb):
        o, xb = go + b * step, b * QK
        qo = o + step - 128
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o + PREFETCH_BYTES + 64)
        prefetch(w, o + PREFETCH_BYTES + 128)
        hb = load_i8x32(w, o + 16)  # (Q5_0: the 5th bits; Q4_0: unused)
        a = _codes(w, qo, hb, 0, five)
        c = _codes(w, qo + 32, hb, 1, five)
        h8 = load_f16x8(w, o)
        l0, h0 = _tok8(l0, h0, a, c, xq, t0 * n_in + xb, xd[t0 * nb + b], h8, off)
        if nt >= 2:
            l1, h1 = _tok8(l1, h1, a, c, xq, t1 * n_in + xb, xd[t1 * nb + b], h8, off)
        if nt == 4:
            l2, h2 = _tok8(l2, h2, a, c, xq, t2 * n_in + xb, xd[t2 * nb + b], h8, off)
            l3, h3 = _tok8(l3, h3, a, c, xq, t3 * n_in + xb, xd[t3 * nb + b], h8, off)
    store_f32x8(y, t0 * n_out + r0, pairsum_sub_f32(l0, h0, zero_f32()))
    if nt >= 2:
        store_f32x8(y, t1 * n_out + r0, pairsum_sub_f32(l1, h1, zero_f32()))
    if nt == 4:
        store_f32x8(y, t2 * n_out + r0, pairsum_sub_f32(l2, h2, zero_f32()))
        store_f32x8(y, t3 * n_out + r0, pairsum_sub_f32(l3, h3, zero_f32()))


@njit(cache=True, fastmath=True)
def dot8x4_q4_0_x8(w, go, xq, xd, t0, t1, t2, t3, nb, y, n_out, r0):
    """y[t, r0:r0 + 8] (y flat, n_tok * n_out) = the 8 Q4_0 rows of the group at byte go . tokens t = t0..t3 of
    the flat Q8_0 activations xq, xd (a repeated token is computed again); each equals dot8_q4_0_x8's."""
    _dot8x4(w, go, xq, xd, t0, t1, t2, t3, nb, y, n_out, r0, False, 4)


@njit(cache=True, fastmath=True)
def dot8x4_q5_0_x8(w, go, xq, xd, t0, t1, t2, t3, nb, y, n_out, r0):
    """dot8x4_q4_0_x8 for Q5_0 rows."""
    _dot8x4(w, go, xq, xd, t0, t1, t2, t3, nb, y, n_out, r0, True, 4)


@njit(cache=True, fastmath=True)
def dot8x2_q4_0_x8(w, go, xq, xd, t0, t1, nb, y, n_out, r0):
    """dot8x4_q4_0_x8 for two tokens t0, t1."""
    _dot8x4(w, go, xq, xd, t0, t1, t1, t1, nb, y, n_out, r0, False, 2)


@njit(cache=True, fastmath=True)
def dot8x2_q5_0_x8(w, go, xq, xd, t0, t1, nb, y, n_out, r0):
    """dot8x4_q5_0_x8 for two tokens t0, t1."""
    _dot8x4(w, go, xq, xd, t0, t1, t1, t1, nb, y, n_out, r0, True, 2)


@njit(cache=True)
def unpack_row(w, wo, nb, five, out):
    """The original blocks of the row at byte wo (nb blocks; its offset in the plain shape) -> out (nb * 18 or 22
    bytes), for the float decoders of vec_dot_legacy."""
    row_block = 22 if five else 18
    rb = nb * row_block
    r = wo // rb
    s = r % ROWS
    go = (r - s) * rb
    qs_at = 6 if five else 2
    for b in range(nb):
        o, ob = go + b * 8 * row_block, b * row_block
        out[ob] = w[o + 2 * s]
        out[ob + 1] = w[o + 2 * s + 1]
        if five:  # qh from the 5th bits (the inverse of _repack_groups)
            for k in range(4):
                out[ob + 2 + k] = 0
            for j in range(32):
                c, e, h = (j // 8) % 2, j % 8, j // 16
                bit = (w[o + 16 + 8 * (s % 4) + e] >> (4 * c + 2 * (s // 4) + h)) & 1
                out[ob + 2 + j // 8] |= bit << (j % 8)
        qo = o + 8 * row_block - 128 + 32 * (s // 4) + 8 * (s % 4)
        for c in range(2):
            for e in range(8):
                out[ob + qs_at + 8 * c + e] = w[qo + 64 * c + e]

