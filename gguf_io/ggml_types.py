"""Every GGML tensor type id a GGUF file may name: (name, block_size, type_size), for validating tensor tables.

Values follow ggml's `type_traits` (ggml/src/ggml.c), the same as gguf-py's `GGML_QUANT_SIZES`. Ids 4, 5
(Q4_2, Q4_3) and 31-33, 36-38 (the removed repacked Q4_0_x_x / IQ4_NL_x_x types) are retired and unknown.
Whether a type can be *run* is the quant registry's business (`gguf_io.quants`), not this table's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class GGMLType(NamedTuple):
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block


GGML_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 18),  # block_q4_0: d, qs[16]
    3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22),
    7: GGMLType("Q5_1", 32, 24),
    8: GGMLType("Q8_0", 32, 34),  # block_q8_0: d, qs[32]
    9: GGMLType("Q8_1", 32, 36),  # block_q8_1: d, s (2 halves), qs[32]
    10: GGMLType("Q2_K", 256, 84),
    11: GGMLType("Q3_K", 256, 110),
    12: GGMLType("Q4_K", 256, 144),  # block_q4_K: d, dmin, scales[12], qs[128]
    13: GGMLType("Q5_K", 256, 176),
    14: GGMLType("Q6_K", 256, 210),
    15: GGMLType("Q8_K", 256, 292),
    16: GGMLType("IQ2_XXS", 256, 66),
    17: GGMLType("IQ2_XS", 256, 74),
    18: GGMLType("IQ3_XXS", 256, 98),
    19: GGMLType("IQ1_S", 256, 50),
    20: GGMLType("IQ4_NL", 32, 18),
    21: GGMLType("IQ3_S", 256, 110),
    22: GGMLType("IQ2_S", 256, 82),
    23: GGMLType("IQ4_XS", 256, 136),
    24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4),
    27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8),
    29: GGMLType("IQ1_M", 256, 56),
    30: GGMLType("BF16", 1, 2),
    34: GGMLType("TQ1_0", 256, 54),
    35: GGMLType("TQ2_0", 256, 66),
    39: GGMLType("MXFP4", 32, 17),
}

GGML_TYPE_IDS: dict[str, int] = {t.name: i for i, t in GGML_TYPES.items()}

# Types whose elements are stored one by one: tensor_data() returns them with this dtype (BF16 as raw uint16).
PLAIN_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}
