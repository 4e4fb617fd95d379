"""Embedding lookup: the rows of a quantized matrix for a few token ids, dequantized in compiled code.

Each decoder does the reference's float32 operations in the reference's order (gguf_io.quants_k / quants_legacy,
themselves equal to ggml's dequantize_row_*), without fast-math, so the rows are bit for bit the reference's. A
decode token needs one row: the numpy reference spends ~50 us on it in small array operations, this ~1 us.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kernels_cpu.q8_0_x8 import BLOCK as _X8_BLOCK, QS as _X8_QS  # an 8-row block's bytes, where its codes start

# type name -> (code, bytes a block, values a block) of the types decoded here; Q8_0_X8: Q8_0 rows interleaved by 8
# (kernels_cpu.q8_0_x8, a tied output repacked at load), read in place
TYPES = {"F32": (0, 4, 1), "F16": (1, 2, 1), "Q8_0": (2, 34, 32), "Q4_0": (3, 18, 32), "Q4_K": (4, 144, 256),
         "Q6_K": (5, 210, 256), "Q8_0_X8": (6, 34, 32)}


@njit(cache=True)
def _h2f(lo, hi):
    """The little-endian fp16 of bytes lo, hi as float32 (exact: every fp16 value is a float32 value)."""
    h = np.int64(lo) | (np.int64(hi) << 8)
    sign = -1.0 if h & 0x8000 else 1.0
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        return np.float32(sign * math.ldexp(float(m), -24))
    if e == 31:
        return np.float32(sign * math.inf) if m == 0 else np.float32(math.nan)
    return np.float32(sign * math.ldexp(float(m | 0x400), int(e) - 25))


@njit(cache=True)
def _q4_k_block(b, o, out, j):
    d = _h2f(b[o], b[o + 1])
    dmin = _h2f(b[o + 2], b[o + 3])
    s = b[o + 4:o + 16]
    for sub in range(8):  # get_scale_min_k4
        if sub < 4:
            sc = s[sub] & 63
            mn = s[sub + 4] & 63
        else:
            sc = (s[sub + 4] & 0x0F) | ((s[sub - 4] >> 6) << 4)
            mn = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4)
        d1 = d * np.float32(sc)
        m1 = dmin * np.float32(mn)
        q = o + 16 + (sub // 2) * 32  # runs of 32 bytes: the low nibbles (even sub-block), then the high
        shift = 4 * (sub % 2)
        for l in range(32):
            out[j + 32 * sub + l] = d1 * np.float32((b[q + l] >> shift) & 0x0F) - m1


@njit(cache=True)
def _q6_k_block(b, o, out, j):
    d = _h2f(b[o + 208], b[o + 209])
    for e in range(256):
        h, k, l = e // 128, (e // 32) % 4, e % 32
        low = (b[o + h * 64 + (k % 2) * 32 + l] >> (4 * (k // 2))) & 0x0F
        high = (b[o + 128 + h * 32 + l] >> (2 * k)) & 3
        q = np.int32(low | (high << 4)) - 32
        sc = np.int32(b[o + 192 + e // 16])
        sc = sc - 256 if sc > 127 else sc
        out[j + e] = (d * np.float32(sc)) * np.float32(q)


@njit(cache=True)
def _q8_0_x8_row(flat, rb, i, n_blocks, o_row):
    """Row i of a Q8_0_X8 matrix (rows of rb bytes; kernels_cpu.q8_0_x8's layout: per 8-row block d[8] fp16, then
    codes [chunk j][row][4] as q ^ 0x80) -> o_row, as the Q8_0 decoder: float32(q) * d."""
    s = i % 8
    go = (i - s) * rb
    for blk in range(n_blocks):
        o, j = go + blk * _X8_BLOCK, blk * 32
        d = _h2f(flat[o + 2 * s], flat[o + 2 * s + 1])
        for c in range(8):
            for e in range(4):
                o_row[j + 4 * c + e] = np.float32(np.int32(flat[o + _X8_QS + 32 * c + 4 * s + e]) - 128) * d


PARALLEL_ROWS = 64  # from this many rows (a prompt's embeddings) the rows are decoded on numba's threads; fewer
# (a decode step's) in the calling thread, with no parallel region to start


@njit(cache=True)
def _decode_rows(code, raw, ids, block_bytes, block_vals, out):
    for r in range(ids.shape[0]):
        _decode_row(code, raw, ids, block_bytes, block_vals, out, r)


@njit(cache=True, parallel=True)
def _decode_rows_parallel(code, raw, ids, block_bytes, block_vals, out):
    for r in prange(ids.shape[0]):
        _decode_row(code, raw, ids, block_bytes, block_vals, out, r)


@njit(cache=True)
def _decode_row(code, raw, ids, block_bytes, block_vals, out, r):
    """Row ids[r] of raw, dequantized into out[r]."""
    n_blocks = out.shape[1] // block_vals
    o_row = out[r]
    if code == 6:
        _q8_0_x8_row(raw.reshape(raw.size), raw.shape[1], ids[r], n_blocks, o_row)
        return
    row = raw[ids[r]]
    for blk in range(n_blocks):
        o, j = blk * block_bytes, blk * block_vals
        if code == 0:
            o_row[j] = row[o:o + 4].view(np.float32)[0]
        elif code == 1:
            o_row[j] = _h2f(row[o], row[o + 1])
        elif code == 2:
            d = _h2f(row[o], row[o + 1])
            for l in range(32):
                v = np.int32(row[o + 2 + l])
                o_row[j + l] = np.float32(v - 256 if v > 127 else v) * d
        elif code == 3:
            d = _h2f(row[o], row[o + 1])
            for l in range(16):
                o_row[j + l] = np.float32(np.int32(row[o + 2 + l] & 0x0F) - 8) * d
                o_row[j + l + 16] = np.float32(np.int32(row[o + 2 + l] >> 4) - 8) * d
        elif code == 4:
            _q4_k_block(row, o, o_row, j)
        else:
            _q6_k_block(row, o, o_row, j)


def get_rows(raw: np.ndarray, type_name: str, ids: np.ndarray) -> np.ndarray | None:
    """Rows `ids` of the raw matrix (n_rows, row_bytes) uint8 of type_name, dequantized -> (len(ids), n_cols)
    float32; None for a type not decoded here (the caller uses the numpy reference). ids must lie in range."""
    spec = TYPES.get(type_name)
    if spec is None or raw.ndim != 2:
        return None
    code, block_bytes, block_vals = spec
    n_cols = raw.shape[1] // block_bytes * block_vals
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= raw.shape[0]):
        raise IndexError(f"get_rows: ids must lie in [0, {raw.shape[0]}), found [{ids.min()}, {ids.max()}]")
    out = np.empty((ids.shape[0], n_cols), dtype=np.float32)
    raw = raw.view(np.ndarray)  # read-only, as the file's mapping: one compiled signature for a repacked copy too
    raw.flags.writeable = False
    decode = _decode_rows_parallel if ids.shape[0] >= PARALLEL_ROWS else _decode_rows
    decode(code, raw, ids, block_bytes, block_vals, out)
    return out
