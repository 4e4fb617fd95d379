"""K-quant dots of several tokens at once, for small batches (several sequences decoding, a speculative check):
`rows_dot4`, what vec_dot_k's driver runs for 2-4 tokens of Q4_K_X8 (kernels_cpu.q4_k_x8.dot8x4_q4_k_x8) or Q6_K
rows, and two Q6_K rows (the file's layout) times 4 or 2 tokens, each block's codes and scales unpacked once for all
the tokens instead of once per token.

Each output equals vec_dot_k.dot2_q6_k's bit for bit: the same exact int32 sums (vpmaddubsw of the unsigned 6-bit
codes, minus 32 x, by the 16-element scales through vpmaddwd; the same path with or without VNNI, where
vpdpbusd would still need the per-16 scales multiplied in), then the same float work per output.
"""

from numba import njit

from kernels_cpu import q4_k_x8
from kernels_cpu.vec_dot_legacy import store_2x4

from kernels_cpu.simd import cvt_f32, fma_f32, load_f16, load_i8x32, prefetch, zero_f32
from kernels_cpu.simd_int import add_i32, and_i8, madd, maddubs, or_i8, shl_i8, shr_i8, zero_i32
from kernels_cpu.simd_k import K6_SCALE_SHUF, maddubs_32, scales_i8x8, shuffle_scales, sub_i16

QK_K = 256
PREFETCH_BYTES = 4096  # as vec_dot_k's


@njit(inline="always")
def _codes(w, o, h):
    """The 4 code vectors (unsigned 0..63) and their 4 scale vectors of half h of the block_q6_K at byte o
    (block_q6_K: ql[128], qh[64] at 128, scales[16] at 192, d at 208; as vec_dot_k.isum_q6_k_half)."""
    ql0, ql1 = load_i8x32(w, o + 64 * h), load_i8x32(w, o + 64 * h + 32)
    qh = load_i8x32(w, o + 128 + 32 * h)
    sv = scales_i8x8(w, o + 192 + 8 * h)
    q = (or_i8(and_i8(ql0, 15), shl_i8(and_i8(qh, 3), 4)), or_i8(and_i8(ql1, 15), shl_i8(and_i8(shr_i8(qh, 2), 3), 4)),
         or_i8(shr_i8(ql0, 4), shl_i8(and_i8(shr_i8(qh, 4), 3), 4)), or_i8(shr_i8(ql1, 4), shl_i8(shr_i8(qh, 6), 4)))
    s = (shuffle_scales(sv, K6_SCALE_SHUF, 0), shuffle_scales(sv, K6_SCALE_SHUF, 1),
         shuffle_scales(sv, K6_SCALE_SHUF, 2), shuffle_scales(sv, K6_SCALE_SHUF, 3))
    return q, s


@njit(inline="always")
def _isum(q, s, x0, x1, x2, x3, z0, z1, z2, z3):
    acc = madd(sub_i16(maddubs(q[0], x0), z0), s[0])
    acc = add_i32(acc, madd(sub_i16(maddubs(q[1], x1), z1), s[1]))
    acc = add_i32(acc, madd(sub_i16(maddubs(q[2], x2), z2), s[2]))
    return add_i32(acc, madd(sub_i16(maddubs(q[3], x3), z3), s[3]))


@njit(inline="always")
def _tok(s0, s1, qa, sa, qb, sb, xq, xo):
    """One token's int32 sums of half a block for both rows (its 128 activations at xo)."""
    x0, x1, x2, x3 = load_i8x32(xq, xo), load_i8x32(xq, xo + 32), load_i8x32(xq, xo + 64), load_i8x32(xq, xo + 96)
    z0, z1, z2, z3 = maddubs_32(x0), maddubs_32(x1), maddubs_32(x2), maddubs_32(x3)
    return (add_i32(s0, _isum(qa, sa, x0, x1, x2, x3, z0, z1, z2, z3)),
            add_i32(s1, _isum(qb, sb, x0, x1, x2, x3, z0, z1, z2, z3)))


@njit(inline="always", fastmath=True)
def _dot2_tokens(w, wo, rb, xq, xd, t0, t1, t2, t3, nb, y, n_out, r, four):
    a00, a01, a10, a11 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    a20, a21, a30, a31 = zero_f32(), zero_f32(), zero_f32(), zero_f32()
    n_in = nb * QK_K
    pf = max(PREFETCH_BYTES, rb + 2048)  # vec_dot_legacy.prefetch_distance
    for i in range(nb):
        o, xb = wo + i * 210, i * QK_K
        s00, s01, s10, s11 = zero_i32(), zero_i32(), zero_i32(), zero_i32()
        s20, s21, s30, s31 = zero_i32(), zero_i32(), zero_i32(), zero_i32()
        for h in range(2):
            for k in range(4):
                prefetch(w, wo + 2 * i * 210 + pf + 256 * h + 64 * k)
            qa, sa = _codes(w, o, h)
            qb, sb = _codes(w, o + rb, h)
            s00, s01 = _tok(s00, s01, qa, sa, qb, sb, xq, t0 * n_in + xb + 128 * h)
            s10, s11 = _tok(s10, s11, qa, sa, qb, sb, xq, t1 * n_in + xb + 128 * h)
            if four:
                s20, s21 = _tok(s20, s21, qa, sa, qb, sb, xq, t2 * n_in + xb + 128 * h)
                s30, s31 = _tok(s30, s31, qa, sa, qb, sb, xq, t3 * n_in + xb + 128 * h)
        da, db = load_f16(w, o + 208), load_f16(w, o + rb + 208)
        dx0, dx1, dx2, dx3 = xd[t0 * nb + i], xd[t1 * nb + i], xd[t2 * nb + i], xd[t3 * nb + i]
        a00, a01 = fma_f32(a00, cvt_f32(s00), da * dx0), fma_f32(a01, cvt_f32(s01), db * dx0)
        a10, a11 = fma_f32(a10, cvt_f32(s10), da * dx1), fma_f32(a11, cvt_f32(s11), db * dx1)
        if four:
            a20, a21 = fma_f32(a20, cvt_f32(s20), da * dx2), fma_f32(a21, cvt_f32(s21), db * dx2)
            a30, a31 = fma_f32(a30, cvt_f32(s30), da * dx3), fma_f32(a31, cvt_f32(s31), db * dx3)
    store_2x4(y, n_out, r, rb, t0, t1, t2, t3, four, a00, a01, a10, a11, a20, a21, a30, a31)


@njit(cache=True, fastmath=True)
def dot2x4_q6_k(w, wo, rb, xq, xd, t0, t1, t2, t3, nb, y, n_out, r):
    """y[t, r] and (rb > 0) y[t, r + 1] = the Q6_K rows at bytes wo, wo + rb (nb super-blocks) . tokens
    t = t0..t3 (a repeated token is computed again); xq, xd, y: the flat Q8_K activations and output
    (n_tok * n_out)."""
    _dot2_tokens(w, wo, rb, xq, xd, t0, t1, t2, t3, nb, y, n_out, r, True)


@njit(cache=True, fastmath=True)
def dot2x2_q6_k(w, wo, rb, xq, xd, t0, t1, nb, y, n_out, r):
    """dot2x4_q6_k for two tokens t0, t1."""
    _dot2_tokens(w, wo, rb, xq, xd, t0, t1, t1, t1, nb, y, n_out, r, False)


@njit(cache=True, fastmath=True)
def rows_dot4(x8, w, row_bytes, r0, r1, xq, xd, bsums, t0, t1, t2, t3, y, n_out, nb):
    """vec_dot_k.rows_dot for the tokens t0..t3 at once, of Q4_K_X8 rows (x8) or Q6_K rows: y[t, r] for
    r0 <= r < r1; xq, xd, bsums, y flat. t2 == t1 (then t3 == t1): the two tokens t0, t1 only (2-token kernels)."""
    pair = t2 == t1
    if x8:  # r0, r1: multiples of 8
        for r in range(r0, r1, 8):
            if pair:
                q4_k_x8.dot8x2_q4_k_x8(w, r * row_bytes, xq, xd, bsums, t0, t1, nb, y, n_out, r)
            else:
                q4_k_x8.dot8x4_q4_k_x8(w, r * row_bytes, xq, xd, bsums, t0, t1, t2, t3, nb, y, n_out, r)
    else:
        for r in range(r0, r1, 2):
            rb = row_bytes if r + 1 < r1 else 0
            if pair:
                dot2x2_q6_k(w, r * row_bytes, rb, xq, xd, t0, t1, nb, y, n_out, r)
            else:
                dot2x4_q6_k(w, r * row_bytes, rb, xq, xd, t0, t1, t2, t3, nb, y, n_out, r)
