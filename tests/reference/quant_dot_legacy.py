"""Matrix products on raw 32-element GGML blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (vec_dot_type Q8_0).

The pre-SIMD kernels, moved out of kernels_cpu (which dispatches to vec_dot_legacy, vec_dot_k, gemm_f32): the
baseline `scripts/bench_matmul.py --baseline` times in the same run, and a plain reference the tests check.

Each weight row is decoded once per batch, block by block, into float32 scratch: the block's integer codes
times its fp16 scale (plus its fp16 min for Q4_1/Q5_1). These products are exact in float32 (<= 8-bit code x
11-bit scale), and the activations are the exact values of their Q8_0 blocks, so `row . x` equals ggml's
sum_b d_w[b] * d_x[b] * sum_j q[j] * q8[j] (+ m * d_x * sum q8 for Q4_1/Q5_1) up to float32 rounding.
The per-token product is then one flat float loop that LLVM vectorizes; a per-block integer reduction
cannot be vectorized by Numba (its LLVM pipeline runs no SLP vectorizer, and 32-long loops are fully
unrolled into scalar code).

The 16-long decode loops run to `n16`, a run-time argument that is always 16: with a compile-time bound LLVM
unrolls them completely into scalar code; with a run-time bound it keeps loops and vectorizes them (2-3x).
"""

import numpy as np
from numba import njit, prange

QK = 32  # elements per block for every type in this file
ROWS_PER_TASK = 16  # rows handed to one parallel task: each task allocates its row scratch once

# Type codes for `matmul_legacy` (one compiled kernel serves all six types).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL = 0, 1, 2, 3, 4, 5

# kvalues_iq4nl (ggml-common.h): the 16 non-linear levels of IQ4_NL / IQ4_XS.
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)

# 2**(max(e, 1) - 25) for the 5-bit fp16 exponent e: (mantissa | implicit bit) * this is the value, exactly.
_F16_POW2 = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], dtype=np.float32)


@njit(cache=True)
def f16_bits_to_f32(h):
    """IEEE half bits (an int in [0, 65536)) -> float32, exact, subnormals/inf/nan included."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 31:
        v = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        v = np.float32(m + (1024 if e > 0 else 0)) * _F16_POW2[e]
    return -v if h & 0x8000 else v


@njit(cache=True)
def read_f16(buf, off):
    """The little-endian fp16 stored at buf[off:off+2] (buf uint8) as float32: the block scales."""
    return f16_bits_to_f32(np.int64(buf[off]) | (np.int64(buf[off + 1]) << 8))


@njit(cache=True, fastmath=True)
def dot_f32(a, b):
    """float32 dot product of two equally long 1-D float32 arrays (one flat loop: LLVM vectorizes it)."""
    acc = np.float32(0.0)
    for j in range(a.shape[0]):
        acc += a[j] * b[j]
    return acc


@njit(cache=True, fastmath=True)
def decode_row_q4_0(row, out, n16):
    # block_q4_0: d (fp16), qs[16]; element j = (qs[j] & 15) - 8, element 16 + j = (qs[j] >> 4) - 8
    nb = out.shape[0] // QK
    blocks, o = row.reshape(nb, 18), out.reshape(nb, QK)
    for b in range(nb):
        d = read_f16(blocks[b], 0)
        for j in range(n16):
            o[b, j] = np.float32((np.int32(blocks[b, 2 + j]) & 15) - 8) * d
        for j in range(n16):
            o[b, 16 + j] = np.float32((np.int32(blocks[b, 2 + j]) >> 4) - 8) * d


@njit(cache=True, fastmath=True)
def decode_row_q4_1(row, out, n16):
    # block_q4_1: d, m (fp16), qs[16]; value = d * q + m
    nb = out.shape[0] // QK
    blocks, o = row.reshape(nb, 20), out.reshape(nb, QK)
    for b in range(nb):
        d = read_f16(blocks[b], 0)
        m = read_f16(blocks[b], 2)
        for j in range(n16):
            o[b, j] = np.float32(np.int32(blocks[b, 4 + j]) & 15) * d + m
        for j in range(n16):
            o[b, 16 + j] = np.float32(np.int32(blocks[b, 4 + j]) >> 4) * d + m


@njit(cache=True)
def _read_u32(blk, off):
    return (np.int64(blk[off]) | (np.int64(blk[off + 1]) << 8)
            | (np.int64(blk[off + 2]) << 16) | (np.int64(blk[off + 3]) << 24))


@njit(cache=True, fastmath=True)
def decode_row_q5_0(row, out, n16):
    # block_q5_0: d (fp16), qh[4] (uint32: bit j is the 5th bit of element j), qs[16]; value = d * (q - 16)
    nb = out.shape[0] // QK
    blocks, o = row.reshape(nb, 22), out.reshape(nb, QK)
    for b in range(nb):
        d = read_f16(blocks[b], 0)
        qh = _read_u32(blocks[b], 2)
        for j in range(n16):
            o[b, j] = np.float32(((np.int64(blocks[b, 6 + j]) & 15) | (((qh >> j) & 1) << 4)) - 16) * d
        for j in range(n16):
            o[b, 16 + j] = np.float32(((np.int64(blocks[b, 6 + j]) >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16) * d


@njit(cache=True, fastmath=True)
def decode_row_q5_1(row, out, n16):
    # block_q5_1: d, m (fp16), qh[4], qs[16]; value = d * q + m
    nb = out.shape[0] // QK
    blocks, o = row.reshape(nb, 24), out.reshape(nb, QK)
    for b in range(nb):
        d = read_f16(blocks[b], 0)
        m = read_f16(blocks[b], 2)
        qh = _read_u32(blocks[b], 4)
        for j in range(n16):
            o[b, j] = np.float32((np.int64(blocks[b, 8 + j]) & 15) | (((qh >> j) & 1) << 4)) * d + m
        for j in range(n16):
            o[b, 16 + j] = np.float32((np.int64(blocks[b, 8 + j]) >> 4) | (((qh >> (j + 16)) & 1) << 4)) * d + m


@njit(cache=True, fastmath=True)
def decode_row_q8_0(row, out, n16):
    # block_q8_0: d (fp16), qs[32] int8; value = d * q
    nb = out.shape[0] // QK
    blocks, o = row.reshape(nb, 34), out.reshape(nb, QK)
    for b in range(nb):
        d = read_f16(blocks[b], 0)
        for j in range(2 * n16):
            v = np.int32(blocks[b, 2 + j])
            o[b, j] = np.float32(v - ((v & 128) << 1)) * d  # uint8 -> int8


@njit(cache=True, fastmath=True)
def decode_row_iq4_nl(row, out, n16):
    # block_iq4_nl: d (fp16), qs[16]; value = d * kvalues_iq4nl[nibble], low nibbles first
    # (compile-time loop bounds here: vectorized table lookups become gathers, no faster than scalar code)
    nb = out.shape[0] // QK
    blocks, o = row.reshape(nb, 18), out.reshape(nb, QK)
    for b in range(nb):
        d = read_f16(blocks[b], 0)
        for j in range(16):
            o[b, j] = np.float32(KVALUES_IQ4NL[np.int32(blocks[b, 2 + j]) & 15]) * d
        for j in range(16):
            o[b, 16 + j] = np.float32(KVALUES_IQ4NL[np.int32(blocks[b, 2 + j]) >> 4]) * d


@njit(cache=True, fastmath=True)
def decode_row_legacy(kind, row, out, n16):
    """Decode one row of raw blocks (uint8) of type `kind` into float32 `out` (n_in); n16 must be 16."""
    if kind == Q4_0:
        decode_row_q4_0(row, out, n16)
    elif kind == Q4_1:
        decode_row_q4_1(row, out, n16)
    elif kind == Q5_0:
        decode_row_q5_0(row, out, n16)
    elif kind == Q5_1:
        decode_row_q5_1(row, out, n16)
    elif kind == Q8_0:
        decode_row_q8_0(row, out, n16)
    else:
        decode_row_iq4_nl(row, out, n16)


@njit(cache=True, parallel=True, fastmath=True)
def matmul_legacy(w, kind, xf, y, n16):
    """y[t, r] = row r of w . xf[t].

    w: uint8 (n_out, n_in/32 * type_size) raw blocks of type `kind`; xf: float32 (n_tok, n_in), the values
    of the Q8_0-quantized activations (`act_quant.dequantize_q8_0`); y: float32 (n_tok, n_out).
    n16 must be 16: a run-time argument on purpose (module docstring).
    """
    n_out = w.shape[0]
    n_in = xf.shape[1]
    n_tasks = (n_out + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        row = np.empty(n_in, dtype=np.float32)
        for r in range(task * ROWS_PER_TASK, min(n_out, (task + 1) * ROWS_PER_TASK)):
            decode_row_legacy(kind, w[r], row, n16)  # once per row for the whole batch
            for t in range(xf.shape[0]):
                y[t, r] = dot_f32(row, xf[t])
