"""The quant registry: one `QuantSpec` per supported GGML type, with its numpy reference dequantizer.

Dequantizers are our own code (quants_legacy.py, quants_k.py, quants_iq.py) and equal `gguf.quants.dequantize`
bit for bit; kernels are checked against them.
"""

from dataclasses import dataclass, field
from functools import partial
from math import prod
from typing import Callable, Sequence

import numpy as np

from . import quants_iq as _iq
from . import quants_k as _k
from . import quants_legacy as _legacy
from .errors import GGUFFormatError, UnsupportedQuantType


def _dequantize_raw(
    raw_u8: np.ndarray, *, name: str, block_size: int, type_size: int,
    blocks_fn: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """`(..., n_blocks * type_size) uint8 -> (..., n_blocks * block_size) float32` (always a new array)."""
    raw = np.asarray(raw_u8)
    if raw.dtype != np.uint8:
        raise TypeError(f"{name}: expected a uint8 array of raw blocks, got dtype {raw.dtype}")
    if raw.ndim == 0 or raw.shape[-1] % type_size != 0:
        found = "a 0-d array" if raw.ndim == 0 else f"last axis of {raw.shape[-1]} bytes"
        raise GGUFFormatError(f"{name}: expected a last axis that is a multiple of {type_size} bytes, found {found}")
    n_blocks = raw.shape[-1] // type_size
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)  # (total_blocks, type_size)
    out = blocks_fn(blocks)  # (total_blocks, block_size)
    assert out.dtype == np.float32 and out.shape == (blocks.shape[0], block_size), (name, out.dtype, out.shape)
    return out.reshape(raw.shape[:-1] + (n_blocks * block_size,))


@dataclass(frozen=True)
class QuantSpec:
    """One GGML type: `block_size` elements are stored in `type_size` bytes.

    `dequantize(raw_u8)` maps `(..., n_blocks * type_size) uint8` to `(..., n_blocks * block_size) float32`.
    """

    name: str
    type_id: int
    block_size: int
    type_size: int
    dequantize: Callable[[np.ndarray], np.ndarray] = field(repr=False, compare=False)

    def row_bytes(self, n_elements: int) -> int:
        """Bytes of a row of `n_elements` (must be a multiple of `block_size`)."""
        if n_elements < 0 or n_elements % self.block_size != 0:
            raise GGUFFormatError(
                f"{self.name}: a row of {n_elements} elements is not a multiple of the block size {self.block_size}"
            )
        return n_elements // self.block_size * self.type_size

    def nbytes(self, shape: Sequence[int]) -> int:
        """Bytes of a tensor of numpy-order `shape` (rows along the last axis)."""
        shape = tuple(int(s) for s in shape)
        if not shape:
            return self.row_bytes(1)
        return prod(shape[:-1]) * self.row_bytes(shape[-1])


def spec_from_blocks(
    name: str, type_id: int, block_size: int, type_size: int, blocks_fn: Callable[[np.ndarray], np.ndarray],
) -> QuantSpec:
    """A QuantSpec whose `dequantize` wraps `blocks_fn: (n_blocks, type_size) uint8 -> (n_blocks, block_size) f32`."""
    fn = partial(_dequantize_raw, name=name, block_size=block_size, type_size=type_size, blocks_fn=blocks_fn)
    return QuantSpec(name, type_id, block_size, type_size, fn)


# (name, GGML type id, elements per block, bytes per block, blocks -> float32)
QUANTS: dict[str, QuantSpec] = {
    s.name: s
    for s in (
        spec_from_blocks("F32", 0, 1, 4, _legacy.dequantize_f32),
        spec_from_blocks("F16", 1, 1, 2, _legacy.dequantize_f16),
        spec_from_blocks("Q4_0", 2, 32, 18, _legacy.dequantize_q4_0),
        spec_from_blocks("Q4_1", 3, 32, 20, _legacy.dequantize_q4_1),
        spec_from_blocks("Q5_0", 6, 32, 22, _legacy.dequantize_q5_0),
        spec_from_blocks("Q5_1", 7, 32, 24, _legacy.dequantize_q5_1),
        spec_from_blocks("Q8_0", 8, 32, 34, _legacy.dequantize_q8_0),
        spec_from_blocks("Q2_K", 10, 256, 84, _k.dequantize_q2_k),
        spec_from_blocks("Q3_K", 11, 256, 110, _k.dequantize_q3_k),
        spec_from_blocks("Q4_K", 12, 256, 144, _k.dequantize_q4_k),
        spec_from_blocks("Q5_K", 13, 256, 176, _k.dequantize_q5_k),
        spec_from_blocks("Q6_K", 14, 256, 210, _k.dequantize_q6_k),
        spec_from_blocks("IQ4_NL", 20, 32, 18, _legacy.dequantize_iq4_nl),
        spec_from_blocks("IQ4_XS", 23, 256, 136, _k.dequantize_iq4_xs),
        spec_from_blocks("BF16", 30, 1, 2, _legacy.dequantize_bf16),
        spec_from_blocks("MXFP4", 39, 32, 17, _legacy.dequantize_mxfp4),
        spec_from_blocks("IQ2_XXS", 16, 256, 66, _iq.dequantize_iq2_xxs),
        spec_from_blocks("IQ2_XS", 17, 256, 74, _iq.dequantize_iq2_xs),
        spec_from_blocks("IQ2_S", 22, 256, 82, _iq.dequantize_iq2_s),
        spec_from_blocks("IQ3_XXS", 18, 256, 98, _iq.dequantize_iq3_xxs),
        spec_from_blocks("IQ3_S", 21, 256, 110, _iq.dequantize_iq3_s),
        spec_from_blocks("IQ1_S", 19, 256, 50, _iq.dequantize_iq1_s),
        spec_from_blocks("IQ1_M", 29, 256, 56, _iq.dequantize_iq1_m),
    )
}
_BY_ID: dict[int, QuantSpec] = {s.type_id: s for s in QUANTS.values()}


def _describe(type_id: int) -> str:
    try:  # name the type the way gguf does, when gguf knows it
        from gguf import GGMLQuantizationType

        return f"{GGMLQuantizationType(type_id).name} (type id {type_id})"
    except (ImportError, ValueError):
        return f"type id {type_id}"


def quant_spec(type_id_or_name: int | str) -> QuantSpec:
    """The registry entry for a GGML type id (int, or gguf's GGMLQuantizationType) or name ("Q4_K")."""
    if isinstance(type_id_or_name, str):
        spec = QUANTS.get(type_id_or_name.upper())
        what = repr(type_id_or_name)
    else:
        spec = _BY_ID.get(int(type_id_or_name))
        what = _describe(int(type_id_or_name))
    if spec is None:
        raise UnsupportedQuantType(f"unsupported quant type {what}; supported: {', '.join(QUANTS)}")
    return spec
