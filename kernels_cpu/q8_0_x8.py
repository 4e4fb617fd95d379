"""Q8_0 rows interleaved by 8 (kernels_cpu.legacy_x8's counterpart for Q8_0; what the tied output of a small model
is copied into at load): one 32-byte register holds 4 codes of each of 8 rows, so with VNNI one vpdpbusd against
a broadcast of 4 activation bytes takes 8 rows x 4 values, an int32 lane a row, and the float work of a block
(one convert, one scale vector, one fma) serves 8 rows.

Layout: rows 8G..8G + 7 form group G, nb blocks of 8 rows each, block b of group G at byte (G * nb + b) * 272:

    0    d[8]          fp16, row r's at 2r
    16   qs[8][8][4]   [chunk j][row r][e]: element 4j + e of row r as an unsigned byte, q ^ 0x80 (= q + 128)

The arrays keep the matrix shape (n_out, nb * 34). Products are ggml's (block_q8_0 . block_q8_0): per block and
row an exact int32 sum of q * q8, times d_w * d_x in float32, summed over the blocks in order. With VNNI the sum
is vpdpbusd's sum of (q + 128) q8 minus 128 * the block's sum of q8, exactly; without it the codes go back to
signed and through |q| and sign(x) (ggml's AVX2 form). Both give the same int32 lanes, hence the same outputs.
dot8x4 / dot8x2 take 4 or 2 tokens a pass over the block (its codes loaded once); dot8 is the same code for one
token, so a token's outputs do not depend on the tokens it is batched with.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kernels_cpu import x8_layout
from kernels_cpu.simd import (cvt_f32, fmav_f32, load_f16, load_f16x8, load_i8x32, prefetch, store_f32x8, store_scaled,
                              zero_f32)
from kernels_cpu.simd_int import abs_i8, add_i32, addc_i8, dot_u8i8, hsum_i32, sign_i8, splat_i8, zero_i32
from kernels_cpu.simd_x8 import bcast_i8x4, dpbusd, gather_i8x4x8, has_vnni, scale_f32, splat_i32, sub_i32

QK = 32
ROWS = 8
ROW_BLOCK = 34  # block_q8_0: d (fp16), qs[32] int8
BLOCK = ROWS * ROW_BLOCK  # 272 bytes: 8 rows' blocks
QS = 16  # where the codes start in an 8-row block
PREFETCH_BYTES = 4096


def repackable(shape: tuple[int, ...]) -> bool:
    """Whether a matrix of numpy shape (n_out, n_in) can be interleaved: whole groups of 8 rows."""
    return x8_layout.repackable(shape, QK)


def repack(raw: np.ndarray) -> np.ndarray:
    """Q8_0 rows uint8 (n_out, nb * 34) -> the interleaved layout (same shape)."""
    return x8_layout.interleave(raw, "a Q8_0", QK, ROW_BLOCK, ROW_BLOCK, _repack_groups)


@njit(cache=True, parallel=True)
def _repack_groups(src, nb, dst):
    rb = nb * ROW_BLOCK
    for g in prange(src.size // (ROWS * rb)):
        for b in range(nb):
            o = (g * nb + b) * BLOCK
            for r in range(ROWS):
                s = (g * ROWS + r) * rb + b * ROW_BLOCK
                dst[o + 2 * r], dst[o + 2 * r + 1] = src[s], src[s + 1]
                for j in range(8):
                    for e in range(4):
                        dst[o + QS + 32 * j + 4 * r + e] = src[s + 2 + 4 * j + e] ^ 0x80


# -- 8 rows . 1, 2 or 4 tokens ------------------------------------------------------------------------------------
@njit(inline="always")
def _codes(w, qo):
    """The block's 8 chunk registers (rows 0-7 x 4 codes each): unsigned with VNNI, signed (q) without."""
    c = (load_i8x32(w, qo), load_i8x32(w, qo + 32), load_i8x32(w, qo + 64), load_i8x32(w, qo + 96),
         load_i8x32(w, qo + 128), load_i8x32(w, qo + 160), load_i8x32(w, qo + 192), load_i8x32(w, qo + 224))
    if has_vnni():
        return c
    return (addc_i8(c[0], -128), addc_i8(c[1], -128), addc_i8(c[2], -128), addc_i8(c[3], -128),
            addc_i8(c[4], -128), addc_i8(c[5], -128), addc_i8(c[6], -128), addc_i8(c[7], -128))


@njit(inline="always")
def _sdot(q, a, x):
    """int32 lanes of sum q * x over a row's 4 codes (q signed, a = |q|; x the broadcast activations)."""
    return dot_u8i8(a, sign_i8(x, q))


@njit(inline="always", fastmath=True)
def _tok(f, c, a, xq, xo, dx, d8, c128):
    """One token's step over one block: f + (its 8 rows' exact int32 sums of q * q8) * d_w * d_x."""
    if has_vnni():  # two chains of 4, then 128 * sum(q8) off
        i0 = dpbusd(dpbusd(dpbusd(dpbusd(zero_i32(), c[0], bcast_i8x4(xq, xo)), c[1], bcast_i8x4(xq, xo + 4)),
                           c[2], bcast_i8x4(xq, xo + 8)), c[3], bcast_i8x4(xq, xo + 12))
        i1 = dpbusd(dpbusd(dpbusd(dpbusd(zero_i32(), c[4], bcast_i8x4(xq, xo + 16)), c[5], bcast_i8x4(xq, xo + 20)),
                           c[6], bcast_i8x4(xq, xo + 24)), c[7], bcast_i8x4(xq, xo + 28))
        s = hsum_i32(dpbusd(zero_i32(), c128, load_i8x32(xq, xo)))
        i = sub_i32(add_i32(i0, i1), splat_i32(s))
    else:
        i0 = add_i32(add_i32(_sdot(c[0], a[0], bcast_i8x4(xq, xo)), _sdot(c[1], a[1], bcast_i8x4(xq, xo + 4))),
                     add_i32(_sdot(c[2], a[2], bcast_i8x4(xq, xo + 8)), _sdot(c[3], a[3], bcast_i8x4(xq, xo + 12))))
        i1 = add_i32(add_i32(_sdot(c[4], a[4], bcast_i8x4(xq, xo + 16)), _sdot(c[5], a[5], bcast_i8x4(xq, xo + 20))),
                     add_i32(_sdot(c[6], a[6], bcast_i8x4(xq, xo + 24)), _sdot(c[7], a[7], bcast_i8x4(xq, xo + 28))))
        i = add_i32(i0, i1)
    return fmav_f32(f, cvt_f32(i), scale_f32(d8, dx))


@njit(inline="always")
def _dot8x4(w, go, xq, xd, t0, t1, t2, t3, nb, y, n_out, r0, nt):
    """The 8 rows of the group at byte go . the first nt (1, 2 or 4) of the tokens t0..t3 (a literal at each call,
    so the branches fold away); y flat (n_tok * n_out)."""
    n_in = nb * QK
    c128 = splat_i8(128)
    f0, f1, f2, f3 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    for b in range(nb):
        o, xb = go + b * BLOCK, b * QK
        for p in range(0, BLOCK + 63, 64):
            prefetch(w, o + PREFETCH_BYTES + p)
        c = _codes(w, o + QS)
        a = c if has_vnni() else (abs_i8(c[0]), abs_i8(c[1]), abs_i8(c[2]), abs_i8(c[3]), abs_i8(c[4]),
                                  abs_i8(c[5]), abs_i8(c[6]), abs_i8(c[7]))
        d8 = load_f16x8(w, o)
        f0 = _tok(f0, c, a, xq, t0 * n_in + xb, xd[t0 * nb + b], d8, c128)
        if nt >= 2:
            f1 = _tok(f1, c, a, xq, t1 * n_in + xb, xd[t1 * nb + b], d8, c128)
        if nt == 4:
            f2 = _tok(f2, c, a, xq, t2 * n_in + xb, xd[t2 * nb + b], d8, c128)
            f3 = _tok(f3, c, a, xq, t3 * n_in + xb, xd[t3 * nb + b], d8, c128)
    store_f32x8(y, t0 * n_out + r0, f0)
    if nt >= 2:
        store_f32x8(y, t1 * n_out + r0, f1)
    if nt == 4:
        store_f32x8(y, t2 * n_out + r0, f2)
        store_f32x8(y, t3 * n_out + r0, f3)


@njit(cache=True, fastmath=True)
def dot8_q8_0_x8(w, go, xq, xd, nb, y, r0):
    """y[r0:r0 + 8] = the 8 Q8_0 rows of the group at byte go . one token's Q8_0 activations (xq, xd)."""
    _dot8x4(w, go, xq, xd, 0, 0, 0, 0, nb, y, 0, r0, 1)


@njit(cache=True, fastmath=True)
def dot8x4_q8_0_x8(w, go, xq, xd, t0, t1, t2, t3, nb, y, n_out, r0):
    """y[t, r0:r0 + 8] (y flat, n_tok * n_out) = the 8 rows of the group at byte go . tokens t = t0..t3 of the flat
    Q8_0 activations xq, xd (a repeated token is computed again); each equals dot8_q8_0_x8's bit for bit."""
    _dot8x4(w, go, xq, xd, t0, t1, t2, t3, nb, y, n_out, r0, 4)


@njit(cache=True, fastmath=True)
def dot8x2_q8_0_x8(w, go, xq, xd, t0, t1, nb, y, n_out, r0):
    """dot8x4_q8_0_x8 for two tokens t0, t1."""
    _dot8x4(w, go, xq, xd, t0, t1, t1, t1, nb, y, n_out, r0, 2)


# -- rows back out: the float GEMM's decoder and the embedding lookup ---------------------------------------------
@njit(inline="always")
def _where(wo, nb):
    """(byte of the row's first 8-row block, its row in the group) for the row at byte wo of the plain shape."""
    r = wo // (nb * ROW_BLOCK)
    s = r % ROWS
    return (r - s) * nb * ROW_BLOCK, s


@njit(inline="always", fastmath=True)
def decode_row_f32(w, wo, nb, out, oo):
    """The row at byte wo (its offset in the plain shape; nb blocks) -> float32 out[oo:oo + 32 nb], ggml's
    dequantize_row_q8_0 (q * d)."""
    go, s = _where(wo, nb)
    zero = np.float32(0.0)
    for b in range(nb):
        o = go + b * BLOCK
        q = addc_i8(gather_i8x4x8(w, o + QS + 4 * s, 32), -128)
        d = load_f16(w, o + 2 * s)
        store_scaled(out, oo + b * QK, q, d, zero, d, zero)

