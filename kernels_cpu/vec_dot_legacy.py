"""SIMD dot products of raw 32-element GGML blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) with Q8_0 (Q8_1 for
Q4_1/Q5_1) activations, as ggml's ggml_vec_dot_*_q8_0 on AVX2, plus the float32 row decoders the batched GEMM uses.

Per block the weight codes are unpacked into one 32-byte vector (`simd`), multiplied with the 32 int8
activations into exact int32 lanes (vpmaddubsw/vpmaddwd), converted to float32 and accumulated with the
block scale d_w * d_x: y = sum_b d_w[b] d_x[b] sum_j q[j] q8[j] (+ m[b] * d_x[b] sum_j q8[j] for Q4_1/Q5_1).
Signed codes (Q4_0 q-8, Q5_0 q-16, Q8_0, IQ4_NL and MXFP4 levels) go through |q| and sign(q) * q8 like ggml.

Activations: xq int8 (n_tok, n_in), xd float32 (n_tok, n_in/32), and for Q4_1/Q5_1 xs float32 (n_tok, n_in/32):
block_q8_1's s, fp16(d_x * sum q8) with d_x before its fp16 rounding (kernels_cpu.act_quant.quantize_q8_1), as
ggml_vec_dot_q4_1_q8_1 multiplies the weight's min by it. (d_x16 * sum q8 instead, the same in exact arithmetic,
moved SmolLM2-135M Q4_1's perplexity by +0.2% from llama.cpp's and from a float64 forward.) Weight offsets are
linear byte offsets into the C-contiguous (n_out, row_bytes) w.

Small batches (several sequences decoding, a speculative check): for Q8_0 and the X8 layouts of Q4_0/Q5_0/Q8_0 the
driver passes each block of rows once per 4 tokens (rows_dot4: dot2x4_q8_0, legacy_x8.dot8x4_*,
q8_0_x8.dot8x4_q8_0_x8; 2-token forms for a pair), which load and unpack the weights once and keep an accumulator per token. Each output equals the 1-token
kernel's bit for bit: the same exact int32 lanes (with VNNI through vpdpbusd, an unsigned operand shifted by 128
or an offset taken off exactly), then the same float ops in the same order.
"""

import numpy as np
from numba import njit, prange

from gguf_io.quants_legacy import e8m0_to_fp32_half
from kernels_cpu import legacy_x8, mxfp4_x8, q8_0_x8
from kernels_cpu.sched import next_task
from kernels_cpu.simd import (cvt_f32, fma_f32, hsum_f32, load_bits32, load_f16, load_i8x32, load_nib16, prefetch,
                              store_scaled, zero_f32)
from kernels_cpu.simd_int import abs_i8, addc_i8, dot_u8i8, lut16_i8, or_i8, sign_i8, splat_i8, zero_i32
from kernels_cpu.simd_x8 import dpbusd, has_vnni, sub_i32

QK = 32
PREFETCH_BYTES = 2048
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL = 0, 1, 2, 3, 4, 5  # type codes (one compiled driver for all of them)
Q4_0_X8, Q5_0_X8 = 6, 7  # rows interleaved by 8 (kernels_cpu.legacy_x8): calls cover whole groups of 8 rows
MXFP4 = 8
MXFP4_X8 = 9  # MXFP4 rows interleaved by 8 (kernels_cpu.mxfp4_x8)
Q8_0_X8 = 10  # Q8_0 rows interleaved by 8 (kernels_cpu.q8_0_x8)
TYPE_SIZE = np.array([18, 20, 22, 24, 34, 18, 18, 22, 17, 17, 34], dtype=np.int64)

# kvalues_iq4nl (ggml-common.h): the 16 non-linear levels of IQ4_NL / IQ4_XS, as bytes for the lookup.
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8).view(np.uint8)
# kvalues_mxfp4 (ggml-common.h): e2m1 values doubled; E8M0_HALF[e] = ggml_e8m0_to_fp32_half(e) = 2**(e - 128).
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8).view(np.uint8)
E8M0_HALF = e8m0_to_fp32_half(np.arange(256, dtype=np.uint8))


# -- per type: the block's codes (an I8x32 of small signed values), scale d and offset m --------------------
@njit(inline="always")
def block_q4_0(w, o):
    # block_q4_0: d (fp16), qs[16]; element j = (qs[j] & 15) - 8, element 16 + j = (qs[j] >> 4) - 8
    return addc_i8(load_nib16(w, o + 2), -8), load_f16(w, o)


@njit(inline="always")
def block_q4_1(w, o):
    # block_q4_1: d, m (fp16), qs[16]; value = d * q + m
    return load_nib16(w, o + 4), load_f16(w, o), load_f16(w, o + 2)


@njit(inline="always")
def block_q5_0(w, o):
    # block_q5_0: d (fp16), qh[4] (bit j: the 5th bit of element j), qs[16]; value = d * (q - 16)
    return addc_i8(or_i8(load_nib16(w, o + 6), load_bits32(w, o + 2, 16)), -16), load_f16(w, o)


@njit(inline="always")
def block_q5_1(w, o):
    # block_q5_1: d, m (fp16), qh[4], qs[16]; value = d * q + m
    return or_i8(load_nib16(w, o + 8), load_bits32(w, o + 4, 16)), load_f16(w, o), load_f16(w, o + 2)


@njit(inline="always")
def block_q8_0(w, o):
    # block_q8_0: d (fp16), qs[32] int8
    return load_i8x32(w, o + 2), load_f16(w, o)


@njit(inline="always")
def block_iq4_nl(w, o):
    # block_iq4_nl: d (fp16), qs[16]; value = d * kvalues_iq4nl[nibble], low nibbles first
    return lut16_i8(load_nib16(w, o + 2), KVALUES_IQ4NL, 0), load_f16(w, o)


@njit(inline="always")
def block_mxfp4(w, o):
    # block_mxfp4: e (e8m0), qs[16]; value = 2**(e - 128) * kvalues_mxfp4[nibble], low nibbles first
    return lut16_i8(load_nib16(w, o + 1), KVALUES_MXFP4, 0), E8M0_HALF[w[o]]


# -- two weight rows . one token's Q8_0 activations: dot2_<type>(w, wo, rb, xq, xd, [xs,] nb) ---------------
# Rows at bytes wo and wo + rb (nb blocks) . one token (xq, xd, xs: its rows of the activation arrays).
# Two rows per pass share the activation loads and give the core two independent chains (~1.3x a row at a
# time). The two rows are adjacent, one stream of 2 * row_bytes: a software prefetch prefetch_distance ahead in
# it takes a matrix larger than the caches from ~8 to ~18-20 GB/s on one Zen 3 core. The block helpers are
# inline="always": LLVM cannot inline a callee that Numba loaded from its cache. One function per type: a
# branch on the type inside one shared loop measured ~20% slower.
@njit(inline="always")
def prefetch_distance(rb, least):
    """How far ahead of a pair of rows (row_bytes rb; 0 for a lone last row) a dot prefetches in the pair's stream
    (offset 2 * the bytes done in a row): `least`, or for long rows a row and 2 KB beyond the pair's own bytes,
    which keeps both rows' streams ahead. Measured on one Zen 3 core, weights beyond the caches, against a fixed
    distance: Q8_0 2048 x 8192 14 -> 19 GB/s, 8192 x 2048 16-18 -> 18-20.5, 640-wide rows equal or 3% ahead;
    Q6_K 2048 x 8192 9.0 -> 12.7; Q4_K (which had prefetched in each row's own stream) 2048 x 8192 10.4 -> 11.8,
    8192 x 2048 10.6 -> 11.5."""
    return max(least, rb + 2048)


@njit(inline="always", fastmath=True)
def sdot(q, x):
    """float32 lanes summing to sum_j q[j] x[j] for signed codes q (|q| <= 128) and Q8 activations x."""
    return cvt_f32(dot_u8i8(abs_i8(q), sign_i8(x, q)))


@njit(cache=True, fastmath=True)
def dot2_q4_0(w, wo, rb, xq, xd, nb):
    a0 = zero_f32()
    a1 = zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for b in range(nb):
        x, dx, o = load_i8x32(xq, b * QK), xd[b], wo + b * 18
        prefetch(w, wo + 2 * b * 18 + pf)
        q, d = block_q4_0(w, o)
        a0 = fma_f32(a0, sdot(q, x), d * dx)
        q, d = block_q4_0(w, o + rb)
        a1 = fma_f32(a1, sdot(q, x), d * dx)
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def dot2_q5_0(w, wo, rb, xq, xd, nb):
    a0 = zero_f32()
    a1 = zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for b in range(nb):
        x, dx, o = load_i8x32(xq, b * QK), xd[b], wo + b * 22
        prefetch(w, wo + 2 * b * 22 + pf)
        q, d = block_q5_0(w, o)
        a0 = fma_f32(a0, sdot(q, x), d * dx)
        q, d = block_q5_0(w, o + rb)
        a1 = fma_f32(a1, sdot(q, x), d * dx)
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def dot2_q8_0(w, wo, rb, xq, xd, nb):
    a0 = zero_f32()
    a1 = zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for b in range(nb):
        x, dx, o = load_i8x32(xq, b * QK), xd[b], wo + b * 34
        prefetch(w, wo + 2 * b * 34 + pf)
        prefetch(w, wo + 2 * b * 34 + pf + 64)
        q, d = block_q8_0(w, o)
        a0 = fma_f32(a0, sdot(q, x), d * dx)
        q, d = block_q8_0(w, o + rb)
        a1 = fma_f32(a1, sdot(q, x), d * dx)
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def dot2_iq4_nl(w, wo, rb, xq, xd, nb):
    a0 = zero_f32()
    a1 = zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for b in range(nb):
        x, dx, o = load_i8x32(xq, b * QK), xd[b], wo + b * 18
        prefetch(w, wo + 2 * b * 18 + pf)
        q, d = block_iq4_nl(w, o)
        a0 = fma_f32(a0, sdot(q, x), d * dx)
        q, d = block_iq4_nl(w, o + rb)
        a1 = fma_f32(a1, sdot(q, x), d * dx)
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def dot2_mxfp4(w, wo, rb, xq, xd, nb):
    a0 = zero_f32()
    a1 = zero_f32()
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for b in range(nb):
        x, dx, o = load_i8x32(xq, b * QK), xd[b], wo + b * 17
        prefetch(w, wo + 2 * b * 17 + pf)
        q, d = block_mxfp4(w, o)
        a0 = fma_f32(a0, sdot(q, x), d * dx)
        q, d = block_mxfp4(w, o + rb)
        a1 = fma_f32(a1, sdot(q, x), d * dx)
    return hsum_f32(a0), hsum_f32(a1)


@njit(cache=True, fastmath=True)
def dot2_q4_1(w, wo, rb, xq, xd, xs, nb):
    a0 = zero_f32()
    a1 = zero_f32()
    m0 = np.float32(0.0)
    m1 = np.float32(0.0)
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for b in range(nb):
        x, dx, sx, o = load_i8x32(xq, b * QK), xd[b], xs[b], wo + b * 20
        prefetch(w, wo + 2 * b * 20 + pf)
        q, d, m = block_q4_1(w, o)
        a0 = fma_f32(a0, cvt_f32(dot_u8i8(q, x)), d * dx)
        m0 += m * sx
        q, d, m = block_q4_1(w, o + rb)
        a1 = fma_f32(a1, cvt_f32(dot_u8i8(q, x)), d * dx)
        m1 += m * sx
    return hsum_f32(a0) + m0, hsum_f32(a1) + m1


@njit(cache=True, fastmath=True)
def dot2_q5_1(w, wo, rb, xq, xd, xs, nb):
    a0 = zero_f32()
    a1 = zero_f32()
    m0 = np.float32(0.0)
    m1 = np.float32(0.0)
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    for b in range(nb):
        x, dx, sx, o = load_i8x32(xq, b * QK), xd[b], xs[b], wo + b * 24
        prefetch(w, wo + 2 * b * 24 + pf)
        q, d, m = block_q5_1(w, o)
        a0 = fma_f32(a0, cvt_f32(dot_u8i8(q, x)), d * dx)
        m0 += m * sx
        q, d, m = block_q5_1(w, o + rb)
        a1 = fma_f32(a1, cvt_f32(dot_u8i8(q, x)), d * dx)
        m1 += m * sx
    return hsum_f32(a0) + m0, hsum_f32(a1) + m1


# -- two weight rows . four tokens (a small batch): the block is loaded and unpacked once for all of them --------
@njit(inline="always")
def store_2x4(y, n_out, r, rb, t0, t1, t2, t3, four, a00, a01, a10, a11, a20, a21, a30, a31):
    """A two-row, several-token dot's outputs (the 2x4 / 2x2 kernels here and in k_tokens): y[t, r] = the lane sum
    of a{t}0 and, where rb > 0 (a second row), y[t, r + 1] = that of a{t}1, for t0, t1 and, when `four`, t2, t3
    (a repeated token stores the same value to the same place); y flat (n_tok * n_out)."""
    y[t0 * n_out + r], y[t1 * n_out + r] = hsum_f32(a00), hsum_f32(a10)
    if rb:
        y[t0 * n_out + r + 1], y[t1 * n_out + r + 1] = hsum_f32(a01), hsum_f32(a11)
    if four:
        y[t2 * n_out + r], y[t3 * n_out + r] = hsum_f32(a20), hsum_f32(a30)
        if rb:
            y[t2 * n_out + r + 1], y[t3 * n_out + r + 1] = hsum_f32(a21), hsum_f32(a31)


@njit(inline="always", fastmath=True)
def _q8_0_tok(a0, a1, qa, qb, na, nbb, ua, ub, x, da, db, dx):
    """One token's step of dot2x4_q8_0: the same int32 lanes as sdot (with VNNI: the activations shifted to
    unsigned, x + 128, through vpdpbusd from -128 sum q, the same exact sums), the same float work."""
    if has_vnni():
        xu = addc_i8(x, -128)
        return (fma_f32(a0, cvt_f32(dpbusd(na, xu, qa)), da * dx),
                fma_f32(a1, cvt_f32(dpbusd(nbb, xu, qb)), db * dx))
    return (fma_f32(a0, cvt_f32(dot_u8i8(ua, sign_i8(x, qa))), da * dx),
            fma_f32(a1, cvt_f32(dot_u8i8(ub, sign_i8(x, qb))), db * dx))


@njit(inline="always", fastmath=True)
def _dot2_tokens(w, wo, rb, xq, xd, t0, t1, t2, t3, nb, y, n_out, r, four):
    a00, a01, a10, a11 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    a20, a21, a30, a31 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    n_in = nb * QK
    o0, o1, o2, o3 = t0 * n_in, t1 * n_in, t2 * n_in, t3 * n_in
    pf = prefetch_distance(rb, PREFETCH_BYTES)
    c128 = splat_i8(128)
    for b in range(nb):
        o, xb = wo + b * 34, b * QK
        prefetch(w, wo + 2 * b * 34 + pf)
        prefetch(w, wo + 2 * b * 34 + pf + 64)
        qa, da = block_q8_0(w, o)
        qb, db = block_q8_0(w, o + rb)
        na = sub_i32(zero_i32(), dpbusd(zero_i32(), c128, qa))  # (VNNI) -128 sum q, per lane
        nbb = sub_i32(zero_i32(), dpbusd(zero_i32(), c128, qb))
        ua, ub = abs_i8(qa), abs_i8(qb)
        a00, a01 = _q8_0_tok(a00, a01, qa, qb, na, nbb, ua, ub, load_i8x32(xq, o0 + xb), da, db, xd[t0 * nb + b])
        a10, a11 = _q8_0_tok(a10, a11, qa, qb, na, nbb, ua, ub, load_i8x32(xq, o1 + xb), da, db, xd[t1 * nb + b])
        if four:
            a20, a21 = _q8_0_tok(a20, a21, qa, qb, na, nbb, ua, ub, load_i8x32(xq, o2 + xb), da, db, xd[t2 * nb + b])
            a30, a31 = _q8_0_tok(a30, a31, qa, qb, na, nbb, ua, ub, load_i8x32(xq, o3 + xb), da, db, xd[t3 * nb + b])
    store_2x4(y, n_out, r, rb, t0, t1, t2, t3, four, a00, a01, a10, a11, a20, a21, a30, a31)


@njit(cache=True, fastmath=True)
def dot2x4_q8_0(w, wo, rb, xq, xd, t0, t1, t2, t3, nb, y, n_out, r):
    """y[t, r] and (rb > 0) y[t, r + 1] = the Q8_0 rows at bytes wo, wo + rb (nb blocks) . tokens t = t0..t3 (a
    repeated token is computed again and stored to the same place); xq, xd, y: the flat activation and output
    arrays, y (n_tok * n_out). Each output equals dot2_q8_0's bit for bit."""
    _dot2_tokens(w, wo, rb, xq, xd, t0, t1, t2, t3, nb, y, n_out, r, True)


@njit(cache=True, fastmath=True)
def dot2x2_q8_0(w, wo, rb, xq, xd, t0, t1, nb, y, n_out, r):
    """dot2x4_q8_0 for two tokens t0, t1."""
    _dot2_tokens(w, wo, rb, xq, xd, t0, t1, t1, t1, nb, y, n_out, r, False)


@njit(inline="always")
def has_tok4(kind):
    """Whether rows_dot4 takes this type (the others go a token at a time)."""
    return kind == Q8_0 or kind == Q4_0_X8 or kind == Q5_0_X8 or kind == Q8_0_X8


@njit(cache=True, fastmath=True)
def rows_dot4(kind, w, row_bytes, r0, r1, xq, xd, t0, t1, t2, t3, y, n_out, nb):
    """rows_dot for the tokens t0..t3 at once (types of has_tok4): y[t, r] for r0 <= r < r1; xq, xd, y flat.
    t2 == t1 (then t3 == t1): the two tokens t0, t1 only, through the 2-token kernels."""
    pair = t2 == t1
    if kind == Q8_0_X8:  # r0, r1: multiples of 8
        for r in range(r0, r1, 8):
            if pair:
                q8_0_x8.dot8x2_q8_0_x8(w, r * row_bytes, xq, xd, t0, t1, nb, y, n_out, r)
            else:
                q8_0_x8.dot8x4_q8_0_x8(w, r * row_bytes, xq, xd, t0, t1, t2, t3, nb, y, n_out, r)
    elif kind == Q5_0_X8:  # r0, r1: multiples of 8
        for r in range(r0, r1, 8):
            if pair:
                legacy_x8.dot8x2_q5_0_x8(w, r * row_bytes, xq, xd, t0, t1, nb, y, n_out, r)
            else:
                legacy_x8.dot8x4_q5_0_x8(w, r * row_bytes, xq, xd, t0, t1, t2, t3, nb, y, n_out, r)
    elif kind == Q4_0_X8:
        for r in range(r0, r1, 8):
            if pair:
                legacy_x8.dot8x2_q4_0_x8(w, r * row_bytes, xq, xd, t0, t1, nb, y, n_out, r)
            else:
                legacy_x8.dot8x4_q4_0_x8(w, r * row_bytes, xq, xd, t0, t1, t2, t3, nb, y, n_out, r)
    else:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            if pair:
                dot2x2_q8_0(w, r * row_bytes, rb, xq, xd, t0, t1, nb, y, n_out, r)
            else:
                dot2x4_q8_0(w, r * row_bytes, rb, xq, xd, t0, t1, t2, t3, nb, y, n_out, r)


@njit(cache=True, fastmath=True)
def rows_dot(kind, w, row_bytes, r0, r1, xq, xd, xs, y, nb):
    """y[r] = row r . one token for r0 <= r < r1, two rows at a time (an odd last row goes twice);
    w the flat weight bytes, xq/xd/xs/y the token's rows. One loop per type: each inlines its own dot2."""
    if kind == Q8_0_X8:  # r0, r1: multiples of 8
        for r in range(r0, r1, 8):
            q8_0_x8.dot8_q8_0_x8(w, r * row_bytes, xq, xd, nb, y, r)
    elif kind == Q5_0_X8:  # r0, r1: multiples of 8
        for r in range(r0, r1, 8):
            legacy_x8.dot8_q5_0_x8(w, r * row_bytes, xq, xd, nb, y, r)
    elif kind == Q4_0_X8:
        for r in range(r0, r1, 8):
            legacy_x8.dot8_q4_0_x8(w, r * row_bytes, xq, xd, nb, y, r)
    elif kind == MXFP4_X8:
        for r in range(r0, r1, 8):
            mxfp4_x8.dot8_mxfp4_x8(w, r * row_bytes, xq, xd, nb, y, r)
    elif kind == Q4_0:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q4_0(w, r * row_bytes, rb, xq, xd, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind == Q5_0:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q5_0(w, r * row_bytes, rb, xq, xd, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind == Q8_0:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q8_0(w, r * row_bytes, rb, xq, xd, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind == IQ4_NL:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_iq4_nl(w, r * row_bytes, rb, xq, xd, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind == MXFP4:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_mxfp4(w, r * row_bytes, rb, xq, xd, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    elif kind == Q4_1:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q4_1(w, r * row_bytes, rb, xq, xd, xs, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1
    else:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            v0, v1 = dot2_q5_1(w, r * row_bytes, rb, xq, xd, xs, nb)
            y[r] = v0
            if rb:
                y[r + 1] = v1


@njit(inline="always")
def _signed(kind):
    """Whether a type's codes are signed (no min term): Q4_0, Q5_0, Q8_0, IQ4_NL and the interleaved ones."""
    return (kind == Q4_0 or kind == Q5_0 or kind == Q8_0 or kind == IQ4_NL or kind == Q4_0_X8 or kind == Q5_0_X8
            or kind == MXFP4 or kind == MXFP4_X8 or kind == Q8_0_X8)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_q8_0_act(w0, w1, w2, k0, k1, k2, xq, xd, xs, y0, y1, y2, rows_per_task, rows_per_block, n_threads,
                    counter):
    """y_m[t, r] = row r of w_m . token t for up to three weights times the same tokens (q/k/v, gate/up), for n_tok
    small enough that integer dots beat the float GEMM; an unused slot is a weight of 0 rows.

    w_m: uint8 (n_out_m, row_bytes_m) raw blocks of type k_m; xq/xd/xs: Q8_1 activations (module docstring; the
    signed types read xq and xd only, as Q8_0's);
    y_m: float32 (n_tok, n_out_m); n_threads: numba.get_num_threads(); counter:
    kernels_cpu.sched.new_counter(). Tasks of `rows_per_task`
    contiguous rows, first all of w0's, then w1's, then w2's, are claimed one at a time by the threads (one parallel
    region serves all three); a task runs its rows in blocks of `rows_per_block`, which stay in L1 while every
    token passes.
    """
    n_tok, n_in = xq.shape
    nb = n_in // QK
    t0 = (w0.shape[0] + rows_per_task - 1) // rows_per_task
    t1 = (w1.shape[0] + rows_per_task - 1) // rows_per_task
    n_tasks = t0 + t1 + (w2.shape[0] + rows_per_task - 1) // rows_per_task
    f0, f1, f2 = w0.reshape(w0.size), w1.reshape(w1.size), w2.reshape(w2.size)  # linear byte offsets
    xq_f, xd_f = xq.reshape(xq.size), xd.reshape(xd.size)
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
            four = n_tok > 1 and has_tok4(kind)
            y_f = y.reshape(y.size)
            for b0 in range(r0, r1, rows_per_block):  # blocks of rows stay in L1 while every token passes
                b1 = min(r1, b0 + rows_per_block)
                t = 0
                if four:  # 4 tokens a pass over the block (a last 3 repeat their last token; a last 2: 2-token dots)
                    for t in range(0, n_tok - 1, 4):
                        rows_dot4(kind, w, row_bytes, b0, b1, xq_f, xd_f, t, t + 1, min(t + 2, n_tok - 1),
                                  min(t + 3, n_tok - 1), y_f, n_out, nb)
                    t = n_tok - n_tok % 4 if n_tok % 4 == 1 else n_tok
                for t in range(t, n_tok):
                    rows_dot(kind, w, row_bytes, b0, b1, xq[t], xd[t], xs[t], y[t], nb)
            task = next_task(counter)


# -- float32 decoding of a row (for the batched GEMM) ---------------------------------------------------------
@njit(cache=True, fastmath=True)
def decode_row_f32(kind, w, wo, nb, out, oo):
    """Row of `kind` at byte wo (nb blocks) -> float32 out[oo:oo + 32 nb], exactly ggml's dequantize."""
    if kind == Q4_0_X8 or kind == Q5_0_X8:  # the row's original blocks, then their decoder
        row = np.empty(nb * TYPE_SIZE[kind], dtype=np.uint8)
        legacy_x8.unpack_row(w, wo, nb, kind == Q5_0_X8, row)
        _decode_plain(Q5_0 if kind == Q5_0_X8 else Q4_0, row, 0, nb, out, oo)
    elif kind == MXFP4_X8:
        mxfp4_x8.decode_row_f32(w, wo, nb, out, oo)
    elif kind == Q8_0_X8:
        q8_0_x8.decode_row_f32(w, wo, nb, out, oo)
    else:
        _decode_plain(kind, w, wo, nb, out, oo)


@njit(inline="always", fastmath=True)
def _decode_plain(kind, w, wo, nb, out, oo):
    zero = np.float32(0.0)
    if kind == Q4_0:
        for b in range(nb):
            q, d = block_q4_0(w, wo + b * 18)
            store_scaled(out, oo + b * QK, q, d, zero, d, zero)
    elif kind == Q4_1:
        for b in range(nb):
            q, d, m = block_q4_1(w, wo + b * 20)
            store_scaled(out, oo + b * QK, q, d, m, d, m)
    elif kind == Q5_0:
        for b in range(nb):
            q, d = block_q5_0(w, wo + b * 22)
            store_scaled(out, oo + b * QK, q, d, zero, d, zero)
    elif kind == Q5_1:
        for b in range(nb):
            q, d, m = block_q5_1(w, wo + b * 24)
            store_scaled(out, oo + b * QK, q, d, m, d, m)
    elif kind == Q8_0:
        for b in range(nb):
            q, d = block_q8_0(w, wo + b * 34)
            store_scaled(out, oo + b * QK, q, d, zero, d, zero)
    elif kind == MXFP4:
        for b in range(nb):
            q, d = block_mxfp4(w, wo + b * 17)
            store_scaled(out, oo + b * QK, q, d, zero, d, zero)
    else:
        for b in range(nb):
            q, d = block_iq4_nl(w, wo + b * 18)
            store_scaled(out, oo + b * QK, q, d, zero, d, zero)
