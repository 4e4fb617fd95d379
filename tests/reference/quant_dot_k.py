"""Matrix products on raw 256-element GGML super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS
(vec_dot_type Q8_K), integer dot products as in ggml's ggml_vec_dot_*_q8_K.

The pre-SIMD kernels, moved out of kernels_cpu (which dispatches to vec_dot_legacy, vec_dot_k, gemm_f32): the
baseline `scripts/bench_matmul.py --baseline` times in the same run, and a plain reference the tests check.

Each weight row is decoded once per batch into int16 codes already multiplied by their sub-block's integer
scale (|code * scale| <= 4096), plus per super-block float scales d, dmin and per 16-element integer mins.
Then, per token and super-block, one flat 256-long int16 x int8 loop (LLVM vectorizes it) gives
isum = sum_j code_j * scale_j * q8_j exactly in int32, and
    y += d_x * (d * isum - dmin * sum_g min_g * bsums_g)
where bsums are the Q8_K block's 16-element sums of q8 (only Q2_K, Q4_K, Q5_K have mins), as in ggml.

The 16/32-long decode loops run to `n16` (or 2 * n16), a run-time argument that is always 16: Numba's LLVM
pipeline has no SLP vectorizer, so a loop with a compile-time bound of 16 or 32 is unrolled completely into
scalar code, while a run-time bound keeps a loop that the loop vectorizer handles (2-3x faster decoding).
"""

import numpy as np
from numba import njit, prange

from .quant_dot_legacy import KVALUES_IQ4NL, ROWS_PER_TASK, dot_f32, read_f16

QK_K = 256

# Type codes for `matmul_k` (one compiled kernel serves all six types).
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = 0, 1, 2, 3, 4, 5


@njit(cache=True, fastmath=True)
def decode_row_q2_k(row, w16, d, dmin, mins, n16):
    # block_q2_K: scales[16] (per 16 elements: low nibble scale, high nibble min), qs[64], d, dmin (fp16)
    # element 128k + 32j + l = (qs[32k + l] >> 2j) & 3, in 16-element sub-block g = 8k + 2j + l // 16
    nb = d.shape[0]
    blocks, o, mn = row.reshape(nb, 84), w16.reshape(nb, QK_K), mins.reshape(nb, 16)
    for i in range(nb):
        d[i] = read_f16(blocks[i], 80)
        dmin[i] = read_f16(blocks[i], 82)
        for g in range(16):
            mn[i, g] = np.int32(blocks[i, g]) >> 4
        for k in range(2):
            for j in range(4):
                for half in range(2):
                    g = 8 * k + 2 * j + half
                    sc = np.int32(blocks[i, g]) & 0xF
                    src = 16 + 32 * k + 16 * half
                    for l in range(n16):
                        o[i, 16 * g + l] = np.int16(((np.int32(blocks[i, src + l]) >> (2 * j)) & 3) * sc)


@njit(cache=True)
def _scale_q3_k(blk, j):
    """The 6-bit scale of sub-block j (0..15) of a block_q3_K (scales[12] at byte 96), minus 32."""
    b = np.int32(blk[96 + j % 8])
    low = b & 0xF if j < 8 else b >> 4
    high = (np.int32(blk[104 + j % 4]) >> (2 * (j // 4))) & 3
    return np.int32(low | (high << 4)) - 32


@njit(cache=True, fastmath=True)
def decode_row_q3_k(row, w16, d, dmin, mins, n16):
    # block_q3_K: hmask[32], qs[64], scales[12] (6-bit, 16 sub-blocks), d (fp16)
    # element 128k + 32j + l = ((qs[32k + l] >> 2j) & 3) - (0 if hmask[l] has bit 4k + j else 4)
    nb = d.shape[0]
    blocks, o = row.reshape(nb, 110), w16.reshape(nb, QK_K)
    for i in range(nb):
        d[i] = read_f16(blocks[i], 108)
        dmin[i] = 0.0
        for k in range(2):
            for j in range(4):
                bit = 4 * k + j
                for half in range(2):
                    g = 8 * k + 2 * j + half
                    sc = _scale_q3_k(blocks[i], g)
                    src = 32 + 32 * k + 16 * half
                    for l in range(n16):
                        q = (((np.int32(blocks[i, src + l]) >> (2 * j)) & 3) - 4
                             + 4 * ((np.int32(blocks[i, 16 * half + l]) >> bit) & 1))
                        o[i, 16 * g + l] = np.int16(q * sc)


@njit(cache=True)
def _scale_min_k4(blk, j):
    """get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) of a q4_K/q5_K block (scales at 4)."""
    if j < 4:
        return np.int32(blk[4 + j]) & 63, np.int32(blk[8 + j]) & 63
    a, b, c = np.int32(blk[j]), np.int32(blk[4 + j]), np.int32(blk[8 + j])
    return (c & 0xF) | ((a >> 6) << 4), (c >> 4) | ((b >> 6) << 4)


@njit(cache=True, fastmath=True)
def decode_row_q4_k(row, w16, d, dmin, mins, n16):
    # block_q4_K: d, dmin (fp16), scales[12] (6-bit scale+min for 8 sub-blocks of 32), qs[128]
    # element 64j + l = qs[32j + l] & 15 (sub-block 2j), element 64j + 32 + l = qs[32j + l] >> 4 (2j + 1)
    nb = d.shape[0]
    blocks, o, mn = row.reshape(nb, 144), w16.reshape(nb, QK_K), mins.reshape(nb, 16)
    for i in range(nb):
        d[i] = read_f16(blocks[i], 0)
        dmin[i] = read_f16(blocks[i], 2)
        for j in range(4):
            s0, m0 = _scale_min_k4(blocks[i], 2 * j)
            s1, m1 = _scale_min_k4(blocks[i], 2 * j + 1)
            mn[i, 4 * j], mn[i, 4 * j + 1], mn[i, 4 * j + 2], mn[i, 4 * j + 3] = m0, m0, m1, m1
            for l in range(2 * n16):
                o[i, 64 * j + l] = np.int16((np.int32(blocks[i, 16 + 32 * j + l]) & 15) * s0)
            for l in range(2 * n16):
                o[i, 64 * j + 32 + l] = np.int16((np.int32(blocks[i, 16 + 32 * j + l]) >> 4) * s1)


@njit(cache=True, fastmath=True)
def decode_row_q5_k(row, w16, d, dmin, mins, n16):
    # block_q5_K: d, dmin (fp16), scales[12], qh[32], qs[128]; q4_K plus a 5th bit:
    # element 64j + l gets bit 2j of qh[l], element 64j + 32 + l gets bit 2j + 1
    nb = d.shape[0]
    blocks, o, mn = row.reshape(nb, 176), w16.reshape(nb, QK_K), mins.reshape(nb, 16)
    for i in range(nb):
        d[i] = read_f16(blocks[i], 0)
        dmin[i] = read_f16(blocks[i], 2)
        for j in range(4):
            s0, m0 = _scale_min_k4(blocks[i], 2 * j)
            s1, m1 = _scale_min_k4(blocks[i], 2 * j + 1)
            mn[i, 4 * j], mn[i, 4 * j + 1], mn[i, 4 * j + 2], mn[i, 4 * j + 3] = m0, m0, m1, m1
            for l in range(2 * n16):
                q = (np.int32(blocks[i, 48 + 32 * j + l]) & 15) | (
                    ((np.int32(blocks[i, 16 + l]) >> (2 * j)) & 1) << 4)
                o[i, 64 * j + l] = np.int16(q * s0)
            for l in range(2 * n16):
                q = (np.int32(blocks[i, 48 + 32 * j + l]) >> 4) | (
                    ((np.int32(blocks[i, 16 + l]) >> (2 * j + 1)) & 1) << 4)
                o[i, 64 * j + 32 + l] = np.int16(q * s1)


@njit(cache=True, fastmath=True)
def decode_row_q6_k(row, w16, d, dmin, mins, n16):
    # block_q6_K: ql[128], qh[64], scales[16] (int8, per 16), d (fp16)
    # half h, s in 0..3, l < 32: element 128h + 32s + l = (low | high << 4) - 32 with
    # low = ql[64h + l + 32 * (s & 1)] & 15 (s < 2) or >> 4 (s >= 2), high = (qh[32h + l] >> 2s) & 3
    nb = d.shape[0]
    blocks, o = row.reshape(nb, 210), w16.reshape(nb, QK_K)
    for i in range(nb):
        d[i] = read_f16(blocks[i], 208)
        dmin[i] = 0.0
        for h in range(2):
            for s in range(4):
                shift = 0 if s < 2 else 4
                for half in range(2):
                    g = 8 * h + 2 * s + half  # 16-element sub-block
                    sc = np.int32(blocks[i, 192 + g])
                    sc = sc - ((sc & 128) << 1)  # int8
                    src_l = 64 * h + 32 * (s & 1) + 16 * half
                    src_h = 128 + 32 * h + 16 * half
                    for l in range(n16):
                        q = ((np.int32(blocks[i, src_l + l]) >> shift) & 15) | (
                            ((np.int32(blocks[i, src_h + l]) >> (2 * s)) & 3) << 4)
                        o[i, 16 * g + l] = np.int16((q - 32) * sc)


@njit(cache=True, fastmath=True)
def decode_row_iq4_xs(row, w16, d, dmin, mins, n16):
    # block_iq4_xs: d (fp16), scales_h (uint16), scales_l[4], qs[128]; sub-block ib (of 32) has the 6-bit
    # scale (nibble ib of scales_l | bits 2ib..2ib+1 of scales_h << 4) - 32; element 32ib + j =
    # kvalues[qs[16ib + j] & 15], element 32ib + 16 + j = kvalues[qs[16ib + j] >> 4]
    # (compile-time loop bounds here: vectorized table lookups become gathers, slower than scalar code)
    nb = d.shape[0]
    blocks, o = row.reshape(nb, 136), w16.reshape(nb, QK_K)
    for i in range(nb):
        d[i] = read_f16(blocks[i], 0)
        dmin[i] = 0.0
        scales_h = np.int32(blocks[i, 2]) | (np.int32(blocks[i, 3]) << 8)
        for ib in range(8):
            low = (np.int32(blocks[i, 4 + ib // 2]) >> (4 * (ib % 2))) & 0xF
            sc = (low | (((scales_h >> (2 * ib)) & 3) << 4)) - 32
            for j in range(16):
                v = np.int32(blocks[i, 8 + 16 * ib + j])
                o[i, 32 * ib + j] = np.int16(np.int32(KVALUES_IQ4NL[v & 15]) * sc)
            for j in range(16):
                v = np.int32(blocks[i, 8 + 16 * ib + j])
                o[i, 32 * ib + 16 + j] = np.int16(np.int32(KVALUES_IQ4NL[v >> 4]) * sc)


@njit(cache=True, fastmath=True)
def decode_row_k(kind, row, w16, d, dmin, mins, n16):
    """Decode one row of raw super-blocks (uint8) of type `kind`: w16 int16 (n_in), d/dmin float32 (n_in/256),
    mins int16 (n_in/16; untouched for types without mins, whose dmin is set to 0). n16 must be 16."""
    if kind == Q2_K:
        decode_row_q2_k(row, w16, d, dmin, mins, n16)
    elif kind == Q3_K:
        decode_row_q3_k(row, w16, d, dmin, mins, n16)
    elif kind == Q4_K:
        decode_row_q4_k(row, w16, d, dmin, mins, n16)
    elif kind == Q5_K:
        decode_row_q5_k(row, w16, d, dmin, mins, n16)
    elif kind == Q6_K:
        decode_row_q6_k(row, w16, d, dmin, mins, n16)
    else:
        decode_row_iq4_xs(row, w16, d, dmin, mins, n16)


@njit(cache=True, fastmath=True)
def dot_row_q8_k(w16, d, xq, xd):
    """sum_i d_x[i] * d[i] * isum_i over the super-blocks: a decoded row (w16 int16 (n_in), d float32 (nb)) .
    one token's Q8_K codes and scales (xq int8 (n_in), xd float32 (nb)); each isum_i is exact in int32."""
    acc = np.float32(0.0)
    for i in range(d.shape[0]):
        wb = w16[i * QK_K:(i + 1) * QK_K]
        xb = xq[i * QK_K:(i + 1) * QK_K]
        isum = np.int32(0)
        for j in range(QK_K):  # a compile-time 256: LLVM vectorizes it (too long to unroll completely)
            isum = np.int32(isum + np.int32(wb[j]) * np.int32(xb[j]))
        acc += (xd[i] * d[i]) * np.float32(isum)
    return acc


@njit(cache=True, parallel=True, fastmath=True)
def matmul_k(w, kind, xq, xd, bsums, y, n16):
    """y[t, r] = row r of w . token t.

    w: uint8 (n_out, n_in/256 * type_size) raw super-blocks of type `kind`; xq int8 (n_tok, n_in),
    xd float32 (n_tok, n_in/256), bsums int16 (n_tok, n_in/16): Q8_K activations (`act_quant.quantize_q8_k`);
    y: float32 (n_tok, n_out). n16 must be 16: a run-time argument on purpose (module docstring).
    The min term sum_i d_x[i] * dmin[i] * sum_g min_g * bsums_g is one flat float dot per row and token:
    mins scaled by dmin (per row) . bsums scaled by d_x (per call), both exact in float32 but d_x * bsums.
    """
    n_out = w.shape[0]
    n_tok, n_in = xq.shape
    nb = n_in // QK_K
    has_min = kind == Q2_K or kind == Q4_K or kind == Q5_K
    bsums_x = np.empty((n_tok, n_in // 16), dtype=np.float32)  # d_x * bsums, per 16 activations
    for t in range(n_tok):
        for g in range(n_in // 16):
            bsums_x[t, g] = xd[t, g // 16] * np.float32(bsums[t, g])
    n_tasks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        w16 = np.empty(n_in, dtype=np.int16)
        d = np.empty(nb, dtype=np.float32)
        dmin = np.empty(nb, dtype=np.float32)
        mins = np.zeros(n_in // 16, dtype=np.int16)
        mins_w = np.empty(n_in // 16, dtype=np.float32)  # dmin * min, per 16 weights
        for r in range(task * ROWS_PER_TASK, min(n_out, (task + 1) * ROWS_PER_TASK)):
            decode_row_k(kind, w[r], w16, d, dmin, mins, n16)  # once per row for the whole batch
            if has_min:
                for g in range(n_in // 16):
                    mins_w[g] = dmin[g // 16] * np.float32(mins[g])
            for t in range(n_tok):
                acc = dot_row_q8_k(w16, d, xq[t], xd[t])
                if has_min:
                    acc -= dot_f32(mins_w, bsums_x[t])
                y[t, r] = acc
