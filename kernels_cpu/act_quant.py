"""Activation conversion to a weight type's vec_dot_type, as ggml does before a matrix product.

Q8_0 and Q8_K follow ggml's reference `quantize_row_q8_0_ref` / `quantize_row_q8_K_ref` bit for bit, but are
stored as separate arrays (structure of arrays) rather than packed blocks, so kernels index them directly:
  block_q8_0: d (fp16), qs[32] int8
        -> qs int8 (n_tok, n_in), d float32 (n_tok, n_in/32) holding the fp16 value
  block_q8_K: d (f32), qs[256] int8, bsums[16] int16
        -> qs int8 (n_tok, n_in), d float32 (n_tok, n_in/256), bsums int16 (n_tok, n_in/16)
These functions are compiled without fastmath: they must round exactly like C.
"""

import math

import numpy as np
from numba import njit

QK8_0 = 32
QK_K = 256


@njit(cache=True)
def f32_to_f16_value(v):
    """Round a float32 v >= 0 to the nearest fp16 (ties to even, like GGML_FP32_TO_FP16); float32 result."""
    if v == 0.0:
        return np.float32(0.0)
    _, e = math.frexp(v)  # v = m * 2**e, 0.5 <= m < 1
    q = max(e - 11, -24)  # fp16 keeps 11 significant bits; its smallest step is 2**-24
    r = np.rint(math.ldexp(np.float64(v), -q))
    out = math.ldexp(r, q)
    if out > 65504.0:
        return np.float32(np.inf)
    return np.float32(out)


@njit(cache=True)
def _roundf(v):
    """C roundf: halfway cases away from zero (v is a float32 value; float64 arithmetic here is exact)."""
    a = math.floor(abs(np.float64(v)) + 0.5)
    return -a if v < 0 else a


@njit(cache=True)
def _quantize_q8_0_rows(x, qs, d):
    # quantize_row_q8_0_ref: d = amax/127, qs = roundf(x * (1/d)); d stored as fp16.
    n_tok, n_in = x.shape
    for t in range(n_tok):
        for b in range(n_in // QK8_0):
            base = b * QK8_0
            amax = np.float32(0.0)
            for j in range(QK8_0):
                amax = max(amax, abs(x[t, base + j]))
            db = amax / np.float32(127.0)
            idb = np.float32(1.0) / db if db != 0.0 else np.float32(0.0)
            d[t, b] = f32_to_f16_value(db)
            for j in range(QK8_0):
                qs[t, base + j] = np.int8(_roundf(x[t, base + j] * idb))


def quantize_q8_0(x):
    """x float32 (n_tok, n_in), n_in % 32 == 0 -> (qs int8 (n_tok, n_in), d float32 (n_tok, n_in // 32))."""
    n_tok, n_in = x.shape
    qs = np.empty((n_tok, n_in), dtype=np.int8)
    d = np.empty((n_tok, n_in // QK8_0), dtype=np.float32)
    _quantize_q8_0_rows(x, qs, d)
    return qs, d


@njit(cache=True)
def _quantize_q8_k_rows(x, qs, d, bsums):
    # quantize_row_q8_K_ref: the element of largest magnitude (first one on ties) maps to -127 exactly.
    n_tok, n_in = x.shape
    for t in range(n_tok):
        for b in range(n_in // QK_K):
            base = b * QK_K
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for j in range(QK_K):
                ax = abs(x[t, base + j])
                if ax > amax:
                    amax = ax
                    vmax = x[t, base + j]
            if amax == 0.0:
                d[t, b] = np.float32(0.0)
                for j in range(QK_K):
                    qs[t, base + j] = 0
                for g in range(QK_K // 16):
                    bsums[t, b * 16 + g] = 0
                continue
            iscale = np.float32(-127.0) / vmax
            for j in range(QK_K):
                v = np.rint(x[t, base + j] * iscale)  # nearest_int: ties to even
                qs[t, base + j] = np.int8(min(v, 127.0))
            for g in range(QK_K // 16):
                s = 0
                for j in range(16):
                    s += qs[t, base + g * 16 + j]
                bsums[t, b * 16 + g] = s
            d[t, b] = np.float32(1.0) / iscale


def quantize_q8_k(x):
    """x float32 (n_tok, n_in), n_in % 256 == 0 ->
    (qs int8 (n_tok, n_in), d float32 (n_tok, n_in // 256), bsums int16 (n_tok, n_in // 16))."""
    n_tok, n_in = x.shape
    qs = np.empty((n_tok, n_in), dtype=np.int8)
    d = np.empty((n_tok, n_in // QK_K), dtype=np.float32)
    bsums = np.empty((n_tok, n_in // 16), dtype=np.int16)
    _quantize_q8_k_rows(x, qs, d, bsums)
    return qs, d, bsums


@njit(cache=True)
def dequantize_q8_0(qs, d):
    """The float32 values (n_tok, n_in) of Q8_0 activations: qs * d per 32-block (exact in float32)."""
    n_tok, n_in = qs.shape
    out = np.empty((n_tok, n_in), dtype=np.float32)
    for t in range(n_tok):
        for b in range(n_in // QK8_0):
            db = d[t, b]
            for j in range(b * QK8_0, (b + 1) * QK8_0):
                out[t, j] = np.float32(qs[t, j]) * db
    return out


def round_to_f16(x):
    """float32 array -> float32 array of the nearest fp16 values (GGML_FP32_TO_FP16, ties to even)."""
    return x.astype(np.float16).astype(np.float32)


def round_to_bf16(x):
    """float32 array -> float32 array of the nearest bf16 values, as ggml_compute_fp32_to_bf16 rounds
    (ties to even on the bit pattern; NaN stays a quiet NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (u | np.uint32(0x00400000)) & np.uint32(0xFFFF0000)
    return np.where(nan, quiet, rounded).view(np.float32)
