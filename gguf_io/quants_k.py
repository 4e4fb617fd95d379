"""Reference dequantizers for ggml's 256-element super-block types (K-quants and IQ4_XS).

Each function maps blocks `(n_blocks, type_size) uint8` (C-contiguous) to `(n_blocks, 256) float32`,
written from the structs in ggml-common.h and the `dequantize_row_*` loops of ggml-quants.c, keeping
the C order of float operations (e.g. `(d * sc) * q - dmin * m`) so the results are bit-exact.
"""

import numpy as np

from .quants_legacy import KVALUES_IQ4NL, fp16_field

QK_K = 256

_SHIFT_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_SHIFT_NIBBLE = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
_BITS_8 = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """2-bit fields of Q2_K/Q3_K qs and Q6_K qh: `(n, 64)` -> `(n, 256) uint8`.

    Element `h*128 + j*32 + l` is `(qs[h*32 + l] >> 2j) & 3` (two halves of 128, four shifts, 32 bytes).
    """
    n = qs.shape[0]
    return ((qs.reshape(n, 2, 1, 32) >> _SHIFT_2BIT) & np.uint8(3)).reshape(n, QK_K)


def _nibble_runs(qs: np.ndarray, width: int) -> np.ndarray:
    """qs `(n, m)` -> `(n, 2m) uint8`: for each run of `width` bytes, its low nibbles then its high nibbles."""
    n, m = qs.shape
    runs = qs.reshape(n, m // width, 1, width)
    return ((runs >> _SHIFT_NIBBLE) & np.uint8(0x0F)).reshape(n, 2 * m)


def _bit_planes(qh: np.ndarray) -> np.ndarray:
    """qh `(n, 32)` -> `(n, 256) uint8`: element `b*32 + l` is bit b of qh[l] (Q3_K hmask, Q5_K qh)."""
    n = qh.shape[0]
    return ((qh.reshape(n, 1, 32) >> _BITS_8) & np.uint8(1)).reshape(n, QK_K)


def scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack `scales[12]` of Q4_K/Q5_K into 8 six-bit scales and 8 six-bit mins, each `(n, 8) uint8`.

    get_scale_min_k4: j < 4: sc = s[j] & 63, m = s[j+4] & 63;
    j >= 4: sc = (s[j+4] & 0xF) | (s[j-4] >> 6) << 4, m = (s[j+4] >> 4) | (s[j] >> 6) << 4.
    """
    s0, s1, s2 = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([s0 & np.uint8(63), (s2 & np.uint8(0x0F)) | ((s0 >> np.uint8(6)) << np.uint8(4))], axis=-1)
    mn = np.concatenate([s1 & np.uint8(63), (s2 >> np.uint8(4)) | ((s1 >> np.uint8(6)) << np.uint8(4))], axis=-1)
    return sc, mn


def dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    # block_q2_K: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin (fp16)
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    d = fp16_field(blocks, 80)
    dmin = fp16_field(blocks, 82)
    dl = (d * (scales & np.uint8(0x0F)).astype(np.float32))[:, :, None]  # (n, 16, 1)
    ml = (dmin * (scales >> np.uint8(4)).astype(np.float32))[:, :, None]
    q = _crumbs(blocks[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K `scales[12]` -> 16 signed six-bit scales `(n, 16) float32`.

    Scale i: low 4 bits from byte i (i < 8, low nibble) or byte i-8 (high nibble);
    high 2 bits are bits 2*(i//4)..+1 of byte 8 + i%4; minus 32.
    """
    n = scales.shape[0]
    low = np.concatenate([scales[:, 0:8] & np.uint8(0x0F), scales[:, 0:8] >> np.uint8(4)], axis=-1)
    high = (scales[:, 8:12].reshape(n, 1, 4) >> _SHIFT_2BIT.reshape(1, 4, 1)) & np.uint8(3)  # (n, i//4, i%4)
    s = low | (high.reshape(n, 16) << np.uint8(4))
    return (s.astype(np.int8) - np.int8(32)).astype(np.float32)


def dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    # block_q3_K: hmask[32], qs[64], scales[12], d (fp16); y = d * (sc - 32) * (q2 - (hbit ? 0 : 4))
    n = blocks.shape[0]
    d = fp16_field(blocks, 108)
    dl = (d * _q3_k_scales(blocks[:, 96:108]))[:, :, None]  # (n, 16, 1)
    low = _crumbs(blocks[:, 32:96]).astype(np.int8)
    hbit = _bit_planes(blocks[:, 0:32]).astype(np.int8)
    q = (low - (np.int8(1) - hbit) * np.int8(4)).astype(np.float32).reshape(n, 16, 16)
    return (dl * q).reshape(n, QK_K)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    # block_q4_K: d, dmin (fp16), scales[12], qs[128]; y = (d * sc) * q - dmin * m per 32 elements
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)
    dmin = fp16_field(blocks, 2)
    sc, mn = scale_min_k4(blocks[:, 4:16])
    d1 = (d * sc.astype(np.float32))[:, :, None]  # (n, 8, 1)
    m1 = (dmin * mn.astype(np.float32))[:, :, None]
    q = _nibble_runs(blocks[:, 16:144], 32).reshape(n, 8, 32).astype(np.float32)
    return (d1 * q - m1).reshape(n, QK_K)


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    # block_q5_K: d, dmin (fp16), scales[12], qh[32], qs[128]; q = nibble + 16 * bit(sub-block) of qh[l]
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)
    dmin = fp16_field(blocks, 2)
    sc, mn = scale_min_k4(blocks[:, 4:16])
    d1 = (d * sc.astype(np.float32))[:, :, None]  # (n, 8, 1)
    m1 = (dmin * mn.astype(np.float32))[:, :, None]
    q = _nibble_runs(blocks[:, 48:176], 32) | (_bit_planes(blocks[:, 16:48]) << np.uint8(4))
    return (d1 * q.reshape(n, 8, 32).astype(np.float32) - m1).reshape(n, QK_K)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    # block_q6_K: ql[128], qh[64], scales[16] (int8), d (fp16); y = (d * sc) * ((ql | qh << 4) - 32)
    # Element h*128 + k*32 + l: low nibble (k < 2) or high nibble (k >= 2) of ql[h*64 + (k%2)*32 + l],
    # high bits (qh[h*32 + l] >> 2k) & 3, scale sc[element // 16].
    n = blocks.shape[0]
    low = _nibble_runs(blocks[:, 0:128], 64)  # runs of 64: [h, k//2, k%2, l] == [h, k, l]
    high = _crumbs(blocks[:, 128:192])
    q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = fp16_field(blocks, 208)
    return ((d * sc)[:, :, None] * q.reshape(n, 16, 16)).reshape(n, QK_K)


def dequantize_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    # block_iq4_xs: d (fp16), scales_h (uint16), scales_l[4], qs[128]
    # sub-block ib: ls = (scales_l[ib/2] >> 4*(ib%2)) & 0xF | ((scales_h >> 2ib) & 3) << 4;
    # y = d * (ls - 32) * kvalues_iq4nl[nibble], 16 bytes per sub-block (low nibbles, then high).
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view("<u2")  # (n, 1)
    low = ((blocks[:, 4:8].reshape(n, 4, 1) >> _SHIFT_NIBBLE.reshape(1, 1, 2)) & np.uint8(0x0F)).reshape(n, 8)
    high = ((scales_h >> np.arange(0, 16, 2, dtype=np.uint16)) & np.uint16(3)).astype(np.uint8)
    ls = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = (d * ls.astype(np.float32))[:, :, None]  # (n, 8, 1)
    q = KVALUES_IQ4NL[_nibble_runs(blocks[:, 8:136], 16)].reshape(n, 8, 32)
    return (dl * q).reshape(n, QK_K)
