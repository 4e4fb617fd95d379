"""Reference dequantizers for the plain float types and ggml's 32-element block types (MXFP4 among them).

Each function maps blocks `(n_blocks, type_size) uint8` (C-contiguous) to `(n_blocks, block_size)
float32`, written from the ggml structs in ggml-common.h and the `dequantize_row_*` loops of
ggml-quants.c, with the float operations in the same order so the results are bit-exact.
"""

import numpy as np

QK = 32  # QK4_0 == QK4_1 == QK5_0 == QK5_1 == QK8_0 == QK4_NL

# kvalues_iq4nl (ggml-common.h): the non-linear 4-bit grid shared by IQ4_NL and IQ4_XS.
KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)
_BIT_SHIFTS_32 = np.arange(32, dtype=np.uint32)


def fp16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian fp16 at byte `offset` of every block, as `(n_blocks, 1) float32`."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2").astype(np.float32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """`(n, k) uint8 -> (n, 2k) uint8`: the low nibbles of all k bytes, then the high nibbles.

    This is the order of every 4-bit ggml block: element j is `qs[j] & 0xF`, element j + k is `qs[j] >> 4`.
    """
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _q5_high_bits(blocks: np.ndarray, offset: int) -> np.ndarray:
    """`qh[4]` read as a little-endian uint32: bit j is the fifth bit of element j. -> `(n, 32) uint8`."""
    qh = np.ascontiguousarray(blocks[:, offset:offset + 4]).view("<u4")  # (n, 1)
    return ((qh >> _BIT_SHIFTS_32) & np.uint32(1)).astype(np.uint8)


def dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    # a "block" is one little-endian float32
    return blocks.view("<f4").astype(np.float32)


def dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    # a "block" is one IEEE half
    return blocks.view("<f2").astype(np.float32)


def dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    # a "block" is one bfloat16: the top 16 bits of a float32 (ggml_compute_bf16_to_fp32)
    return (blocks.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    # block_q4_0: d (fp16), qs[16]; y = (q - 8) * d
    d = fp16_field(blocks, 0)
    q = nibbles(blocks[:, 2:18]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    # block_q4_1: d, m (fp16), qs[16]; y = q * d + m
    d = fp16_field(blocks, 0)
    m = fp16_field(blocks, 2)
    q = nibbles(blocks[:, 4:20]).astype(np.float32)
    return d * q + m


def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    # block_q5_0: d (fp16), qh[4], qs[16]; y = ((nibble | high_bit << 4) - 16) * d
    d = fp16_field(blocks, 0)
    q = nibbles(blocks[:, 6:22]) | (_q5_high_bits(blocks, 2) << np.uint8(4))
    return d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    # block_q5_1: d, m (fp16), qh[4], qs[16]; y = (nibble | high_bit << 4) * d + m
    d = fp16_field(blocks, 0)
    m = fp16_field(blocks, 2)
    q = nibbles(blocks[:, 8:24]) | (_q5_high_bits(blocks, 4) << np.uint8(4))
    return d * q.astype(np.float32) + m


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    # block_q8_0: d (fp16), qs[32] (int8); y = q * d
    d = fp16_field(blocks, 0)
    q = np.ascontiguousarray(blocks[:, 2:34]).view(np.int8)
    return q.astype(np.float32) * d


def dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    # block_iq4_nl: d (fp16), qs[16]; y = d * kvalues_iq4nl[nibble], nibble order as in Q4_0
    d = fp16_field(blocks, 0)
    return d * KVALUES_IQ4NL[nibbles(blocks[:, 2:18])]


# kvalues_mxfp4 (ggml-common.h): the e2m1 values doubled (the e8m0 scale below is halved to match).
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: uint8 exponents -> float32 2**(e - 128), as bits (subnormal for e < 2)."""
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def dequantize_mxfp4(blocks: np.ndarray) -> np.ndarray:
    # block_mxfp4: e (e8m0), qs[16]; y = kvalues_mxfp4[nibble] * 2**(e - 128), nibble order as in Q4_0
    d = e8m0_to_fp32_half(blocks[:, 0:1])
    return d * KVALUES_MXFP4[nibbles(blocks[:, 1:17])]
