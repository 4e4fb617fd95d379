"""SIMD dot products of raw codebook super-blocks (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) with Q8_K
activations, as ggml's ggml_vec_dot_iq*_q8_K, plus the float32 row decoders the batched GEMM uses.

Per 32 weights, `parts` gathers their grid entries (gguf_io.iq_grids, 8 or 4 elements an entry) into one unsigned
I8x32 u and their signs into s (+-1 lanes), so the weights' codes are u * s; the sum of codes * q8 is
vpmaddubsw(u, sign(q8, s)), times the integer scale ls = 2 s + 1 of each 16 (vpmaddwd), exact in int32 lanes per
super-block, then scaled in float32 by d_w * d_x * FACTOR (ggml's 0.125 / 0.25 / 1). IQ1_S/IQ1_M's codes are
8 * grid +- 1, i.e. grid +- IQ1S_DELTA in eighths, so their delta term (ggml's sums of q8 times +-1/8) is part of the
same integer dot. Decoded weights are codes * (d * FACTOR * ls): ggml's dequantized values exactly.

Activations: xq int8 (n_tok, n_in), xd float32 (n_tok, n_in/256) (block_q8_K; its bsums are not needed).
Weight offsets are linear byte offsets into the C-contiguous (n_out, row_bytes) w. `kind` codes follow
vec_dot_k's (one compiled driver for every Q8_K type); vec_dot_k.rows_dot hands these kinds on to rows_dot here.
"""

import numpy as np
from numba import njit

from gguf_io import iq_grids
from kernels_cpu.simd import (cvt_f32, fma_f32, hsum_f32, load_f16, load_i8x32, load_u32, prefetch, store_scaled,
                              zero_f32)
from kernels_cpu.simd_int import abs_i8, add_i32, madd, maddubs, shl_i8, sign_i8, splat2_i16, zero_i32
from kernels_cpu.simd_iq import add_i8, grid4x8, grid8x4, signs_u32
from kernels_cpu.vec_dot_legacy import prefetch_distance

QK_K = 256
PREFETCH_BYTES = 4096
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M = 7, 8, 9, 10, 11, 12, 13  # after vec_dot_k's 0..6
FIRST_KIND = IQ2_XXS
TYPE_SIZE = np.array([66, 74, 82, 98, 110, 50, 56], dtype=np.int64)  # by kind - FIRST_KIND
FACTOR = np.array([0.125, 0.125, 0.125, 0.25, 1.0, 0.125, 0.125], dtype=np.float32)

# the grids as flat byte tables (Numba freezes these globals into the compiled code)
G_IQ2XXS = np.ascontiguousarray(iq_grids.IQ2XXS_GRID).reshape(-1)
G_IQ2XS = np.ascontiguousarray(iq_grids.IQ2XS_GRID).reshape(-1)
G_IQ2S = np.ascontiguousarray(iq_grids.IQ2S_GRID).reshape(-1)
G_IQ3XXS = np.ascontiguousarray(iq_grids.IQ3XXS_GRID).reshape(-1)
G_IQ3S = np.ascontiguousarray(iq_grids.IQ3S_GRID).reshape(-1)
G_IQ1S = np.ascontiguousarray(iq_grids.IQ1S_GRID).view(np.uint8).reshape(-1)  # -1 as 0xFF
KSIGNS = np.ascontiguousarray(iq_grids.KSIGNS_IQ2XS).astype(np.int64)
F16_POW = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 32)], dtype=np.float32)


@njit(inline="always")
def f16_bits(h):
    """IEEE half bits (an int) -> float32, exact."""
    e, m = (h >> 10) & 31, h & 1023
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m + (1024 if e else 0)) * F16_POW[e]
    return -v if h & 0x8000 else v


@njit(inline="always")
def ksigns_word(b):
    """32 sign bits from the 4 seven-bit ksigns_iq2xs indices in bits 0..27 of b."""
    return (KSIGNS[b & 127] | (KSIGNS[(b >> 7) & 127] << 8) | (KSIGNS[(b >> 14) & 127] << 16)
            | (KSIGNS[(b >> 21) & 127] << 24))


@njit(inline="always")
def block_d(kind, w, o):
    """The block's fp16 scale d as float32 (block_iq1_m: spread over the top nibbles of its 4 u16 scales)."""
    if kind == IQ1_M:
        u0, u1 = load_u32(w, o + 48), load_u32(w, o + 52)
        h = ((u0 >> 12) & 0xF) | ((u0 >> 24) & 0xF0) | ((u1 >> 4) & 0xF00) | ((u1 >> 16) & 0xF000)
        return f16_bits(h)
    return load_f16(w, o)


@njit(inline="always")
def _iq1_codes(grid, neg_word):
    # 8 * grid +- 1 (grid in -1..1): the weight in eighths of its scale
    return add_i8(shl_i8(grid, 3), signs_u32(neg_word))


@njit(inline="always")
def parts(kind, w, o, g):
    """Weights 32g .. 32g + 31 of the block at byte o: (u, s, ls0, ls1), codes u * s (u unsigned bytes, s +-1),
    integer scale ls0 for the first 16 and ls1 for the second."""
    if kind == IQ2_XXS:
        # block_iq2_xxs: d, qs[32] u16 at 2; per 32: a u32 of 4 grid indices, a u32 of 4 ksigns indices | s << 28
        a, b = load_u32(w, o + 2 + 8 * g), load_u32(w, o + 6 + 8 * g)
        u = grid8x4(G_IQ2XXS, a & 255, (a >> 8) & 255, (a >> 16) & 255, a >> 24)
        ls = 2 * (b >> 28) + 1
        return u, signs_u32(ksigns_word(b)), ls, ls
    if kind == IQ2_XS:
        # block_iq2_xs: d, qs[32] u16 at 2 (9-bit grid index | ksigns index << 9), scales[8] at 66 (a nibble a 16)
        a, b = load_u32(w, o + 2 + 8 * g), load_u32(w, o + 6 + 8 * g)
        q0, q1, q2, q3 = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
        u = grid8x4(G_IQ2XS, q0 & 511, q1 & 511, q2 & 511, q3 & 511)
        sw = KSIGNS[q0 >> 9] | (KSIGNS[q1 >> 9] << 8) | (KSIGNS[q2 >> 9] << 16) | (KSIGNS[q3 >> 9] << 24)
        sc = np.int64(w[o + 66 + g])
        return u, signs_u32(sw), 2 * (sc & 15) + 1, 2 * (sc >> 4) + 1
    if kind == IQ2_S:
        # block_iq2_s: d, qs[32] at 2 (index low bytes), signs[32] at 34, qh[8] at 66 (2 bits an index), scales[8]
        q, qh = load_u32(w, o + 2 + 4 * g), np.int64(w[o + 66 + g])
        u = grid8x4(G_IQ2S, (q & 255) | ((qh << 8) & 0x300), ((q >> 8) & 255) | ((qh << 6) & 0x300),
                    ((q >> 16) & 255) | ((qh << 4) & 0x300), (q >> 24) | ((qh << 2) & 0x300))
        sc = np.int64(w[o + 74 + g])
        return u, signs_u32(load_u32(w, o + 34 + 4 * g)), 2 * (sc & 15) + 1, 2 * (sc >> 4) + 1
    if kind == IQ3_XXS:
        # block_iq3_xxs: d, qs[64] at 2 (8 indices a 32), then u32 scales_and_signs at 66 (ksigns indices | s << 28)
        a, b = load_u32(w, o + 2 + 8 * g), load_u32(w, o + 6 + 8 * g)
        u = grid4x8(G_IQ3XXS, a & 255, (a >> 8) & 255, (a >> 16) & 255, a >> 24,
                    b & 255, (b >> 8) & 255, (b >> 16) & 255, b >> 24)
        ss = load_u32(w, o + 66 + 4 * g)
        ls = 2 * (ss >> 28) + 1
        return u, signs_u32(ksigns_word(ss)), ls, ls
    if kind == IQ3_S:
        # block_iq3_s: d, qs[64] at 2, qh[8] at 66 (bit k: bit 8 of index k), signs[32] at 74, scales[4] at 106
        a, b, qh = load_u32(w, o + 2 + 8 * g), load_u32(w, o + 6 + 8 * g), np.int64(w[o + 66 + g])
        u = grid4x8(G_IQ3S, (a & 255) | ((qh & 1) << 8), ((a >> 8) & 255) | ((qh & 2) << 7),
                    ((a >> 16) & 255) | ((qh & 4) << 6), (a >> 24) | ((qh & 8) << 5),
                    (b & 255) | ((qh & 16) << 4), ((b >> 8) & 255) | ((qh & 32) << 3),
                    ((b >> 16) & 255) | ((qh & 64) << 2), (b >> 24) | ((qh & 128) << 1))
        ls = 2 * ((np.int64(w[o + 106 + g // 2]) >> (4 * (g % 2))) & 15) + 1
        return u, signs_u32(load_u32(w, o + 74 + 4 * g)), ls, ls
    if kind == IQ1_S:
        # block_iq1_s: d, qs[32] at 2 (index low bytes), qh[8] u16 at 34: 3 high bits an index, s at 12, sign at 15
        q, qh = load_u32(w, o + 2 + 4 * g), np.int64(w[o + 34 + 2 * g]) | (np.int64(w[o + 35 + 2 * g]) << 8)
        grid = grid8x4(G_IQ1S, (q & 255) | ((qh & 7) << 8), ((q >> 8) & 255) | (((qh >> 3) & 7) << 8),
                       ((q >> 16) & 255) | (((qh >> 6) & 7) << 8), (q >> 24) | (((qh >> 9) & 7) << 8))
        c = _iq1_codes(grid, 0xFFFFFFFF if qh & 0x8000 else 0)
        ls = 2 * ((qh >> 12) & 7) + 1
        return abs_i8(c), c, ls, ls
    # block_iq1_m: qs[32] at 0, qh[16] at 32 (a nibble an index: 3 high bits, delta sign), scales[8] at 48 (u16:
    # 3-bit scales of each 16, d's nibbles on top)
    q, h0, h1 = load_u32(w, o + 4 * g), np.int64(w[o + 32 + 2 * g]), np.int64(w[o + 33 + 2 * g])
    grid = grid8x4(G_IQ1S, (q & 255) | ((h0 & 7) << 8), ((q >> 8) & 255) | (((h0 >> 4) & 7) << 8),
                   ((q >> 16) & 255) | ((h1 & 7) << 8), (q >> 24) | (((h1 >> 4) & 7) << 8))
    neg = (0xFF if h0 & 8 else 0) | (0xFF00 if h0 & 0x80 else 0) | (0xFF0000 if h1 & 8 else 0)
    c = _iq1_codes(grid, neg | (0xFF000000 if h1 & 0x80 else 0))
    sc = np.int64(w[o + 48 + 2 * (g // 2)]) | (np.int64(w[o + 49 + 2 * (g // 2)]) << 8)
    sh = 6 * (g % 2)
    return abs_i8(c), c, 2 * ((sc >> sh) & 7) + 1, 2 * ((sc >> (sh + 3)) & 7) + 1


# -- two weight rows . one token's Q8_K activations ---------------------------------------------------------------
# As vec_dot_k: rows at bytes wo and wo + rb (nb super-blocks), the activations loaded once for both, a software
# prefetch prefetch_distance(rb, PREFETCH_BYTES) ahead in the pair's stream. `_dot2` is inlined into one cached
# function per type with a constant kind, so every branch on the kind folds away.
@njit(inline="always", fastmath=True)
def _dot2(kind, w, wo, rb, xq, xd, nb):
    ts = TYPE_SIZE[kind - FIRST_KIND]
    factor = FACTOR[kind - FIRST_KIND]
    a0, a1 = zero_f32(), zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for i in range(nb):
        o, xb = wo + i * ts, i * QK_K
        for line in range(0, 2 * ts, 64):
            prefetch(w, wo + 2 * i * ts + pf + line)
        s0, s1 = zero_i32(), zero_i32()
        for g in range(8):
            x = load_i8x32(xq, xb + 32 * g)
            u, s, l0, l1 = parts(kind, w, o, g)
            s0 = add_i32(s0, madd(maddubs(u, sign_i8(x, s)), splat2_i16(l0, l1)))
            u, s, l0, l1 = parts(kind, w, o + rb, g)
            s1 = add_i32(s1, madd(maddubs(u, sign_i8(x, s)), splat2_i16(l0, l1)))
        dx = xd[i] * factor
        a0 = fma_f32(a0, cvt_f32(s0), block_d(kind, w, o) * dx)
        a1 = fma_f32(a1, cvt_f32(s1), block_d(kind, w, o + rb) * dx)
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def dot2_iq2_xxs(w, wo, rb, xq, xd, bsums, nb):
    return _dot2(IQ2_XXS, w, wo, rb, xq, xd, nb)


@njit(cache=True, fastmath=True)
def dot2_iq2_xs(w, wo, rb, xq, xd, bsums, nb):
    return _dot2(IQ2_XS, w, wo, rb, xq, xd, nb)


@njit(cache=True, fastmath=True)
def dot2_iq2_s(w, wo, rb, xq, xd, bsums, nb):
    return _dot2(IQ2_S, w, wo, rb, xq, xd, nb)


@njit(cache=True, fastmath=True)
def dot2_iq3_xxs(w, wo, rb, xq, xd, bsums, nb):
    return _dot2(IQ3_XXS, w, wo, rb, xq, xd, nb)


@njit(cache=True, fastmath=True)
def dot2_iq3_s(w, wo, rb, xq, xd, bsums, nb):
    return _dot2(IQ3_S, w, wo, rb, xq, xd, nb)


@njit(cache=True, fastmath=True)
def dot2_iq1_s(w, wo, rb, xq, xd, bsums, nb):
    return _dot2(IQ1_S, w, wo, rb, xq, xd, nb)


@njit(cache=True, fastmath=True)
def dot2_iq1_m(w, wo, rb, xq, xd, bsums, nb):
    return _dot2(IQ1_M, w, wo, rb, xq, xd, nb)


@njit(inline="always")
def _rows(dot2, w, row_bytes, r0, r1, xq, xd, bsums, y, nb):
    for r in range(r0, r1, 2):
        rb = row_bytes if r + 1 < r1 else 0
        v0, v1 = dot2(w, r * row_bytes, rb, xq, xd, bsums, nb)
        y[r] = v0
        if rb:
            y[r + 1] = v1


@njit(cache=True, fastmath=True)
def rows_dot(kind, w, row_bytes, r0, r1, xq, xd, bsums, y, nb):
    """y[r] = row r . one token for r0 <= r < r1 (vec_dot_k.rows_dot's contract, for the kinds of this module)."""
    if kind == IQ2_XXS:
        _rows(dot2_iq2_xxs, w, row_bytes, r0, r1, xq, xd, bsums, y, nb)
    elif kind == IQ2_XS:
        _rows(dot2_iq2_xs, w, row_bytes, r0, r1, xq, xd, bsums, y, nb)
    elif kind == IQ2_S:
        _rows(dot2_iq2_s, w, row_bytes, r0, r1, xq, xd, bsums, y, nb)
    elif kind == IQ3_XXS:
        _rows(dot2_iq3_xxs, w, row_bytes, r0, r1, xq, xd, bsums, y, nb)
    elif kind == IQ3_S:
        _rows(dot2_iq3_s, w, row_bytes, r0, r1, xq, xd, bsums, y, nb)
    elif kind == IQ1_S:
        _rows(dot2_iq1_s, w, row_bytes, r0, r1, xq, xd, bsums, y, nb)
    else:
        _rows(dot2_iq1_m, w, row_bytes, r0, r1, xq, xd, bsums, y, nb)


# -- float32 decoding of a row (for the batched GEMM) ---------------------------------------------------------
@njit(inline="always", fastmath=True)
def _decode(kind, w, wo, nb, out, oo):
    ts = TYPE_SIZE[kind - FIRST_KIND]
    zero = np.float32(0.0)
    for i in range(nb):
        o = wo + i * ts
        d = block_d(kind, w, o) * FACTOR[kind - FIRST_KIND]
        for g in range(8):
            u, s, l0, l1 = parts(kind, w, o, g)
            store_scaled(out, oo + i * QK_K + 32 * g, sign_i8(u, s), d * np.float32(l0), zero, d * np.float32(l1),
                         zero)


@njit(cache=True, fastmath=True)
def decode_row_f32(kind, w, wo, nb, out, oo):
    """Row of `kind` at byte wo (nb super-blocks) -> float32 out[oo:oo + 256 nb], ggml's dequantized values."""
    if kind == IQ2_XXS:
        _decode(IQ2_XXS, w, wo, nb, out, oo)
    elif kind == IQ2_XS:
        _decode(IQ2_XS, w, wo, nb, out, oo)
    elif kind == IQ2_S:
        _decode(IQ2_S, w, wo, nb, out, oo)
    elif kind == IQ3_XXS:
        _decode(IQ3_XXS, w, wo, nb, out, oo)
    elif kind == IQ3_S:
        _decode(IQ3_S, w, wo, nb, out, oo)
    elif kind == IQ1_S:
        _decode(IQ1_S, w, wo, nb, out, oo)
    else:
        _decode(IQ1_M, w, wo, nb, out, oo)
