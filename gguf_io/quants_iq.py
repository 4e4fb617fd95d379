"""Reference dequantizers for ggml's codebook types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

Each function maps blocks `(n_blocks, type_size) uint8` (C-contiguous) to `(n_blocks, 256) float32`, from the
structs of ggml-common.h and the `dequantize_row_iq*` loops of ggml-quants.c: groups of 8 (or 4) elements are
entries of a grid (gguf_io.iq_grids), with sign bits (IQ2/IQ3) or a +-1/8 shift (IQ1) and a scale per 32 or 16
elements. Float operations keep ggml's order (`db = d * (0.5 + s) * 0.25`, then `db * grid * sign`).
"""

import numpy as np

from . import iq_grids as _g
from .quants_legacy import fp16_field

QK_K = 256
_BITS_8 = np.arange(8, dtype=np.uint8)
_NIBBLE = np.array([0, 4], dtype=np.uint8)


def _sign_bits(signs_u8: np.ndarray) -> np.ndarray:
    """Sign bytes `(n, k) uint8` -> `(n, 8k) float32`: element 8i + j is -1 where bit j of byte i is set, else 1."""
    bits = (signs_u8[..., None] >> _BITS_8) & np.uint8(1)
    return np.where(bits == 0, np.float32(1), np.float32(-1)).reshape(signs_u8.shape[0], -1)


def _nibble_scales(scales: np.ndarray) -> np.ndarray:
    """scales[k] `(n, k) uint8` -> `(n, 2k)`: the low nibble of each byte, then its high nibble (one per 16)."""
    return ((scales[:, :, None] >> _NIBBLE) & np.uint8(0x0F)).reshape(scales.shape[0], -1)


def _u16(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start:stop]).view("<u2")


def _u32(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start:stop]).view("<u4")


def dequantize_iq2_xxs(blocks: np.ndarray) -> np.ndarray:
    # block_iq2_xxs: d (fp16), qs[32] (u16); per 32 elements two u32: a (4 grid indices, one a byte), b:
    # 4 x 7-bit ksigns indices, scale s = b >> 28; y = d * (0.5 + s) * 0.25 * iq2xxs_grid[idx] * sign
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)
    q = _u32(blocks, 2, 66).reshape(n, 8, 2)
    db = (d * (np.float32(0.5) + (q[:, :, 1] >> 28).astype(np.float32)) * np.float32(0.25))[:, :, None]
    sidx = (q[:, :, 1:2] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & np.uint32(0x7F)  # (n, 8, 4)
    signs = _sign_bits(_g.KSIGNS_IQ2XS[sidx].reshape(n, 32)).reshape(n, 8, 32)
    idx = np.ascontiguousarray(q[:, :, 0]).view(np.uint8).reshape(n, 8, 4)
    grid = _g.IQ2XXS_GRID[idx].reshape(n, 8, 32).astype(np.float32)
    return (db * grid * signs).reshape(n, QK_K)


def dequantize_iq2_xs(blocks: np.ndarray) -> np.ndarray:
    # block_iq2_xs: d (fp16), qs[32] (u16: 9-bit grid index | 7-bit ksigns index << 9), scales[8] (a nibble per 16)
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)
    qs = _u16(blocks, 2, 66)  # (n, 32), one per 8 elements
    db = (d * (np.float32(0.5) + _nibble_scales(blocks[:, 66:74]).astype(np.float32)) * np.float32(0.25))[:, :, None]
    signs = _sign_bits(_g.KSIGNS_IQ2XS[qs >> 9]).reshape(n, 16, 16)
    grid = _g.IQ2XS_GRID[qs & np.uint16(511)].reshape(n, 16, 16).astype(np.float32)
    return (db * grid * signs).reshape(n, QK_K)


def dequantize_iq2_s(blocks: np.ndarray) -> np.ndarray:
    # block_iq2_s: d (fp16), qs[32] (grid index low bytes), signs[32], qh[8] (2 high index bits per 8), scales[8]
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)
    db = (d * (np.float32(0.5) + _nibble_scales(blocks[:, 74:82]).astype(np.float32)) * np.float32(0.25))[:, :, None]
    signs = _sign_bits(blocks[:, 34:66]).reshape(n, 16, 16)
    high = (blocks[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & np.uint8(3)  # (n, 8, 4)
    idx = blocks[:, 2:34].astype(np.uint16) | (high.reshape(n, 32).astype(np.uint16) << np.uint16(8))
    grid = _g.IQ2S_GRID[idx].reshape(n, 16, 16).astype(np.float32)
    return (db * grid * signs).reshape(n, QK_K)


def dequantize_iq3_xxs(blocks: np.ndarray) -> np.ndarray:
    # block_iq3_xxs: d (fp16), qs[64] (grid indices, 4 elements each), then 8 u32 scales_and_signs:
    # 4 x 7-bit ksigns indices, s = >> 28; y = d * (0.5 + s) * 0.5 * iq3xxs_grid[idx] * sign
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)
    ss = _u32(blocks, 66, 98)  # (n, 8)
    db = (d * (np.float32(0.5) + (ss >> 28).astype(np.float32)) * np.float32(0.5))[:, :, None]
    sidx = (ss[:, :, None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & np.uint32(0x7F)  # (n, 8, 4)
    signs = _sign_bits(_g.KSIGNS_IQ2XS[sidx].reshape(n, 32)).reshape(n, 8, 32)
    grid = _g.IQ3XXS_GRID[blocks[:, 2:66]].reshape(n, 8, 32).astype(np.float32)
    return (db * grid * signs).reshape(n, QK_K)


def dequantize_iq3_s(blocks: np.ndarray) -> np.ndarray:
    # block_iq3_s: d (fp16), qs[64] (index low bytes), qh[8] (bit 8 of each index), signs[32], scales[4]
    # (a nibble per 32); y = d * (1 + 2 s) * iq3s_grid[idx] * sign
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)
    db = (d * (1 + 2 * _nibble_scales(blocks[:, 106:110])))[:, :, None]  # uint8 arithmetic, as gguf-py
    signs = _sign_bits(blocks[:, 74:106]).reshape(n, 8, 32)
    high = ((blocks[:, 66:74, None] >> _BITS_8) & np.uint8(1)).reshape(n, 64).astype(np.uint16)
    idx = blocks[:, 2:66].astype(np.uint16) | (high << np.uint16(8))
    grid = _g.IQ3S_GRID[idx].reshape(n, 8, 32).astype(np.float32)
    return (db * grid * signs).reshape(n, QK_K)


def dequantize_iq1_s(blocks: np.ndarray) -> np.ndarray:
    # block_iq1_s: d (fp16), qs[32] (index low bytes), qh[8] (u16: 4 x 3 high index bits, scale s at 12..14,
    # delta sign at 15); y = d * (2 s + 1) * (iq1s_grid[idx] +- 1/8)
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)
    qh = _u16(blocks, 34, 50)  # (n, 8)
    dl = (d * (2 * ((qh >> 12) & 7) + 1))[:, :, None]
    delta = np.where((qh & np.uint16(0x8000)) == 0, np.float32(_g.IQ1S_DELTA), np.float32(-_g.IQ1S_DELTA))
    high = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & np.uint16(7)  # (n, 8, 4)
    idx = blocks[:, 2:34].astype(np.uint16) | (high.reshape(n, 32) << np.uint16(8))
    grid = _g.IQ1S_GRID[idx].reshape(n, 8, 32).astype(np.float32)
    return (dl * (grid + delta[:, :, None])).reshape(n, QK_K)


def iq1_m_scale(blocks: np.ndarray) -> np.ndarray:
    """block_iq1_m's fp16 d, spread over the top nibbles of its 4 u16 scales: `(n, 1) float32`."""
    sc = _u16(blocks, 48, 56)  # (n, 4)
    parts = (sc & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], dtype=np.uint16)
    return (parts[:, 0] | parts[:, 1] | parts[:, 2] | parts[:, 3]).view(np.float16).astype(np.float32)[:, None]


def dequantize_iq1_m(blocks: np.ndarray) -> np.ndarray:
    # block_iq1_m: qs[32] (index low bytes), qh[16] (per 8: 3 high index bits and a delta sign bit, a nibble),
    # scales[8] (4 u16: 3-bit scales, one per 16, and the nibbles of d); y = d * (2 s + 1) * (grid +- 1/8)
    n = blocks.shape[0]
    d = iq1_m_scale(blocks)
    sc = _u16(blocks, 48, 56)
    s = (sc[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & np.uint16(7)  # (n, 4, 4): one per 16
    dl = (d * (2 * s.reshape(n, 16) + 1))[:, :, None]  # (n, 16, 1)
    qh = (blocks[:, 32:48, None] >> _NIBBLE).reshape(n, 32)  # a nibble per 8 elements
    idx = blocks[:, 0:32].astype(np.uint16) | ((qh & np.uint8(7)).astype(np.uint16) << np.uint16(8))
    delta = np.where((qh & np.uint8(8)) == 0, np.float32(_g.IQ1S_DELTA), np.float32(-_g.IQ1S_DELTA))
    grid = _g.IQ1S_GRID[idx].astype(np.float32)  # (n, 32, 8)
    return (dl * (grid + delta[:, :, None]).reshape(n, 16, 16)).reshape(n, QK_K)
