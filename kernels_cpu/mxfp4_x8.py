"""MXFP4 rows interleaved by 8 (kernels_cpu.legacy_x8's layout with the block_mxfp4 fields): copied once at load
into groups of 8 rows, so one activation broadcast serves 4 rows, the codes' sign is handled once per block for all
rows (levels shifted to 0..24, the shift's product with the activations taken off once) instead of through |q| and
sign(x) per row, and a block's float work (scale, convert, accumulate) serves 8 rows.

Layout: rows 8G..8G + 7 form group G, nb blocks of 8 rows each, block b of group G at byte (G * nb + b) * 136:

    0    e[8]              uint8, row r's E8M0 scale
    8    qs[2][2][4][8]    [chunk c][half][row 4 half + i]: bytes 8c..8c + 7 of the row's qs (low nibbles:
                           elements 8c + 0..7; high: 16 + 8c + 0..7), as legacy_x8

The array keeps the matrix shape (n_out, nb * 17). Products are ggml's (ggml_vec_dot_mxfp4_q8_0): per block the
exact int32 sum of kvalues_mxfp4[q] * q8, times E8M0_HALF(e) * d_x in float32; only the float32 summation order
differs from vec_dot_legacy.dot2_mxfp4 (2 lanes per row here, 8 there).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from gguf_io.quants_legacy import e8m0_to_fp32_half
from kernels_cpu import x8_layout
from kernels_cpu.simd import cvt_f32, fmav_f32, load_i8x32, prefetch, store_f32x8, store_scaled, zero_f32
from kernels_cpu.simd_int import add_i16, and_i8, lut16_i8, madd, maddubs, shr_i8, splat_i8, splat_i16, zero_i32
from kernels_cpu.simd_k import sub_i16
from kernels_cpu.simd_x8 import (bcast_i8x8, dpbusd, dup_hi_f32, dup_lo_f32, has_vnni, load_e8m0_half_x8,
                                 load_nib8x2, pairsum_sub_f32, scale_f32, sub_i32)

QK = 32
ROWS = 8
ROW_BLOCK = 17  # block_mxfp4: e, qs[16]
BLOCK = ROWS * ROW_BLOCK
PREFETCH_BYTES = 4096
# kvalues_mxfp4 (ggml-common.h, e2m1 doubled: 0, 1, 2, 3, 4, 6, 8, 12, then negated) + OFFSET: unsigned codes for
# vpmaddubsw; sum (v + 12) q8 - 12 sum q8 = sum v q8. int16 bounds: 4 maddubs of |24 * 127 * 2| sum below 2**15.
OFFSET = 12
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8).view(np.uint8)
KVALUES_U = (KVALUES.view(np.int8).astype(np.int32) + OFFSET).astype(np.uint8)
E8M0_HALF = e8m0_to_fp32_half(np.arange(256, dtype=np.uint8))  # ggml_e8m0_to_fp32_half(e) = 2**(e - 128)


def repackable(shape: tuple[int, ...]) -> bool:
    """Whether a matrix of numpy shape (n_out, n_in) can be interleaved: whole groups of 8 rows."""
    return x8_layout.repackable(shape, QK)


def repack(raw: np.ndarray) -> np.ndarray:
    """MXFP4 rows uint8 (n_out, nb * 17) -> the interleaved layout (same shape); groups in parallel."""
    return x8_layout.interleave(raw, "an MXFP4", QK, ROW_BLOCK, ROW_BLOCK, _repack_groups)


@njit(cache=True, parallel=True)
def _repack_groups(src, nb, dst):
    rb = nb * ROW_BLOCK
    for g in prange(src.size // (ROWS * rb)):
        for b in range(nb):
            o = (g * nb + b) * BLOCK
            for r in range(ROWS):
                s = (g * ROWS + r) * rb + b * ROW_BLOCK
                dst[o + r] = src[s]
                for c in range(2):  # qs: [chunk][half][row in half][8]
                    for e in range(8):
                        dst[o + 8 + 64 * c + 32 * (r // 4) + 8 * (r % 4) + e] = src[s + 1 + 8 * c + e]


@njit(inline="always")
def _half_sum(w, qo, xl0, xl1, xh0, xh1):
    """int16 lanes (4 per row) of sum (v + 12) * q8 over one block of 4 rows: qs of chunk c at qo + 64 c."""
    q0, q1 = load_i8x32(w, qo), load_i8x32(w, qo + 64)
    lo0, hi0 = lut16_i8(and_i8(q0, 15), KVALUES_U, 0), lut16_i8(shr_i8(q0, 4), KVALUES_U, 0)
    lo1, hi1 = lut16_i8(and_i8(q1, 15), KVALUES_U, 0), lut16_i8(shr_i8(q1, 4), KVALUES_U, 0)
    return add_i16(add_i16(maddubs(lo0, xl0), maddubs(hi0, xh0)), add_i16(maddubs(lo1, xl1), maddubs(hi1, xh1)))


@njit(inline="always")
def _half_sum_vnni(w, qo, xl0, xl1, xh0, xh1, z):
    """int32 lanes (2 per row) of sum v * q8 over one block of 4 rows, through vpdpbusd, minus z = 12 * sum q8."""
    q0, q1 = load_i8x32(w, qo), load_i8x32(w, qo + 64)
    acc = dpbusd(zero_i32(), lut16_i8(and_i8(q0, 15), KVALUES_U, 0), xl0)
    acc = dpbusd(acc, lut16_i8(shr_i8(q0, 4), KVALUES_U, 0), xh0)
    acc = dpbusd(acc, lut16_i8(and_i8(q1, 15), KVALUES_U, 0), xl1)
    return sub_i32(dpbusd(acc, lut16_i8(shr_i8(q1, 4), KVALUES_U, 0), xh1), z)


@njit(cache=True, fastmath=True)
def dot8_mxfp4_x8(w, go, xq, xd, nb, y, r0):
    """y[r0:r0 + 8] = the 8 MXFP4 rows of the group at byte go . one token's Q8_0 activations (xq, xd)."""
    off = splat_i8(OFFSET)
    ones = splat_i16(1)
    f_lo, f_hi = zero_f32(), zero_f32()
    for b in range(nb):
        o, xb = go + b * BLOCK, b * QK
        prefetch(w, o + PREFETCH_BYTES)
        prefetch(w, o + PREFETCH_BYTES + 64)
        prefetch(w, o + PREFETCH_BYTES + 128)
        xl0, xl1 = bcast_i8x8(xq, xb), bcast_i8x8(xq, xb + 8)
        xh0, xh1 = bcast_i8x8(xq, xb + 16), bcast_i8x8(xq, xb + 24)
        # the offset times the activations, the same for every row
        if has_vnni():  # 4 products a lane straight into int32 (vpdpbusd)
            z32 = dpbusd(dpbusd(dpbusd(dpbusd(zero_i32(), off, xl0), off, xh0), off, xl1), off, xh1)
            i_lo = _half_sum_vnni(w, o + 8, xl0, xl1, xh0, xh1, z32)
            i_hi = _half_sum_vnni(w, o + 40, xl0, xl1, xh0, xh1, z32)
        else:  # pairs into int16 (vpmaddubsw), then int32 (vpmaddwd)
            z = add_i16(add_i16(maddubs(off, xl0), maddubs(off, xh0)), add_i16(maddubs(off, xl1), maddubs(off, xh1)))
            i_lo = madd(sub_i16(_half_sum(w, o + 8, xl0, xl1, xh0, xh1), z), ones)
            i_hi = madd(sub_i16(_half_sum(w, o + 40, xl0, xl1, xh0, xh1), z), ones)
        d8 = scale_f32(load_e8m0_half_x8(w, o), xd[b])
        f_lo = fmav_f32(f_lo, cvt_f32(i_lo), dup_lo_f32(d8))
        f_hi = fmav_f32(f_hi, cvt_f32(i_hi), dup_hi_f32(d8))
    store_f32x8(y, r0, pairsum_sub_f32(f_lo, f_hi, zero_f32()))


@njit(cache=True, fastmath=True)
def decode_row_f32(w, wo, nb, out, oo):
    """Row at byte wo (nb blocks; its offset in the plain shape) -> float32 out[oo:oo + 32 nb], exactly ggml's
    dequantize of the original MXFP4 row (read in place: the batched GEMM decodes every row of a matrix)."""
    rb = nb * ROW_BLOCK
    r = wo // rb
    s = r % ROWS
    go = (r - s) * rb
    zero = np.float32(0.0)
    for b in range(nb):
        o = go + b * BLOCK
        q = lut16_i8(load_nib8x2(w, o + 8 + 32 * (s // 4) + 8 * (s % 4), 64), KVALUES, 0)
        d = E8M0_HALF[w[o + s]]
        store_scaled(out, oo + b * QK, q, d, zero, d, zero)


@njit(cache=True)
def unpack_row(w, wo, nb, out):
    """The original blocks of the row at byte wo (nb blocks; its offset in the plain shape) -> out (nb * 17 bytes),
    for vec_dot_legacy's float decoder."""
    rb = nb * ROW_BLOCK
    r = wo // rb
    s = r % ROWS
    go = (r - s) * rb
    for b in range(nb):
        o, ob = go + b * BLOCK, b * ROW_BLOCK
        out[ob] = w[o + s]
        qo = o + 8 + 32 * (s // 4) + 8 * (s % 4)
        for c in range(2):
            for e in range(8):
                out[ob + 1 + 8 * c + e] = w[qo + 64 * c + e]
