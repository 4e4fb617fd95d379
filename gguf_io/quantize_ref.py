"""Numpy reference quantizers for what the KV cache and activations need (Q8_0, Q4_0, Q8_K), and MXFP4 weights.

Transcriptions of ggml's quantize_row_q8_0_ref, quantize_row_q4_0_ref, quantize_row_q8_K_ref and
quantize_row_mxfp4_ref (ggml-quants.c) in float32, vectorized over blocks; the kernels' own quantizers are tested
against these.
"""

import numpy as np

from .errors import GGUFFormatError
from .quants import spec_from_blocks
from .quants_legacy import KVALUES_MXFP4, e8m0_to_fp32_half

QK8_0 = 32
QK4_0 = 32
QK_K = 256
QK_MXFP4 = 32
Q8_K_TYPE_SIZE = 4 + QK_K + 2 * (QK_K // 16)  # block_q8_K: d (float32), qs[256] (int8), bsums[16] (int16)


def _blocks(x: np.ndarray, block_size: int, what: str) -> np.ndarray:
    """`(..., n) float -> (..., n // block_size, block_size) float32`."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % block_size != 0:
        n = "a 0-d array" if x.ndim == 0 else f"{x.shape[-1]} elements"
        raise GGUFFormatError(f"{what}: expected a last axis that is a multiple of {block_size}, found {n}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block_size, block_size))


def _to_bytes(lead: tuple[int, ...], *fields: np.ndarray) -> np.ndarray:
    """Concatenate per-block fields `(..., n_blocks, k_i)` as bytes -> `(..., n_blocks * type_size) uint8`."""
    parts = [np.ascontiguousarray(f).view(np.uint8) for f in fields]
    out = np.concatenate(parts, axis=-1)  # (..., n_blocks, type_size)
    return out.reshape(lead + (-1,))


def _inverse(d: np.ndarray) -> np.ndarray:
    """`d ? 1.0f/d : 0.0f` in float32."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C `roundf` (halves away from zero), exact for float32: floor(|v|) + (frac >= 0.5), signed."""
    a = np.abs(v)
    f = np.floor(a)
    return np.copysign(f + (a - f >= np.float32(0.5)), v)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0_ref: `(..., n) float32 -> (..., n/32 * 34) uint8` (block_q8_0: d fp16, qs[32] int8)."""
    xb = _blocks(x, QK8_0, "Q8_0")  # (..., nb, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    q = _round_half_away(xb * _inverse(d)).astype(np.int8)
    return _to_bytes(xb.shape[:-2], d.astype("<f2"), q)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """quantize_row_q4_0_ref: `(..., n) float32 -> (..., n/32 * 18) uint8` (block_q4_0: d fp16, qs[16]).

    d = (the value of largest magnitude, first one on ties) / -8; q = min(15, (int8)(x/d + 8.5)).
    """
    xb = _blocks(x, QK4_0, "Q4_0")  # (..., nb, 32)
    vmax = np.take_along_axis(xb, np.abs(xb).argmax(axis=-1)[..., None], axis=-1)  # (..., nb, 1)
    d = vmax / np.float32(-8)
    q = np.minimum(np.trunc(xb * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)
    qs = q[..., :QK4_0 // 2] | (q[..., QK4_0 // 2:] << np.uint8(4))
    return _to_bytes(xb.shape[:-2], d.astype("<f2"), qs)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5 * 2**23 in float32 and read the mantissa (round half to even)."""
    bits = (v.astype(np.float32) + np.float32(12582912.0)).view(np.int32)
    return (bits & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def quantize_q8_k_parts(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_K_ref: `(..., n) float32` -> d `(..., nb) float32`, qs `(..., nb, 256) int8`,
    bsums `(..., nb, 16) int16` with nb = n / 256.

    iscale = -127 / (value of largest magnitude); q = min(127, nearest_int(iscale * x)); d = 1 / iscale.
    An all-zero block gives d = 0, qs = 0 and bsums = 0 (ggml leaves that block's bsums unwritten).
    """
    xb = _blocks(x, QK_K, "Q8_K")  # (..., nb, 256)
    vmax = np.take_along_axis(xb, np.abs(xb).argmax(axis=-1)[..., None], axis=-1)  # (..., nb, 1)
    nonzero = vmax != 0
    iscale = np.float32(-127.0) / np.where(nonzero, vmax, np.float32(1.0))
    q = np.minimum(_nearest_int(iscale * xb), 127)
    q = np.where(nonzero, q, 0).astype(np.int8)
    bsums = q.reshape(q.shape[:-1] + (QK_K // 16, 16)).sum(axis=-1, dtype=np.int32).astype(np.int16)
    d = np.where(nonzero, np.float32(1.0) / iscale, np.float32(0.0)).astype(np.float32)[..., 0]
    return d, q, bsums


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref as raw blocks: `(..., n) float32 -> (..., n/256 * 292) uint8`."""
    d, q, bsums = quantize_q8_k_parts(x)
    return _to_bytes(q.shape[:-2], d[..., None].astype("<f4"), q, bsums.astype("<i2"))


def _dequantize_q8_k_blocks(blocks: np.ndarray) -> np.ndarray:
    # block_q8_K: d (float32), qs[256] (int8), bsums[16] (int16); y = d * q (dequantize_row_q8_K)
    d = np.ascontiguousarray(blocks[:, 0:4]).view("<f4").astype(np.float32)
    q = np.ascontiguousarray(blocks[:, 4:4 + QK_K]).view(np.int8).astype(np.float32)
    return d * q


# Q8_K is an activation format (GGML type id 15), not a weight type: it is deliberately not in QUANTS.
Q8_K_SPEC = spec_from_blocks("Q8_K", 15, QK_K, Q8_K_TYPE_SIZE, _dequantize_q8_k_blocks)


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """quantize_row_mxfp4_ref: `(..., n) float32 -> (..., n/32 * 17) uint8` (block_mxfp4: e (e8m0), qs[16]).

    e = floor(log2(max |x|)) - 2 + 127 (0 for an all-zero block), d = 2**(e - 128) (ggml_e8m0_to_fp32_half);
    each element takes the nearest of kvalues_mxfp4 * d (the first on ties), low nibbles first as in Q4_0.
    """
    xb = _blocks(x, QK_MXFP4, "MXFP4")  # (..., nb, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)  # (..., nb, 1)
    d = e8m0_to_fp32_half(e)
    err = np.abs(d[..., None] * KVALUES_MXFP4 - xb[..., None])  # (..., nb, 32, 16)
    q = err.argmin(axis=-1).astype(np.uint8)  # argmin: the first of equal errors, as ggml's strict `<`
    qs = q[..., :QK_MXFP4 // 2] | (q[..., QK_MXFP4 // 2:] << np.uint8(4))
    return _to_bytes(xb.shape[:-2], e, qs)
