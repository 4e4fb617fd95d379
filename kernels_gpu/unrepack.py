"""The file's layout back from the CPU's 8-row repacked layouts that only move bytes (unrepack.cu): a GPU layer's
experts in RAM are repacked for the CPU's decode dots and uploaded as they are for a big batch; this puts their
bytes in place for the GPU's dequantization. The permutation comes from the host (hybrid/backends/repack.py
byte_permutation), uploaded once per device and type by the caller."""

from __future__ import annotations

import numpy as np

from .module import get_kernel

THREADS = 256
MAX_CTAS = 8192  # grid-strided beyond this many CTAs


def unrepack_x8(src, perm, type_size: int, out=None):
    """src cupy uint8 (n_rows, row_bytes) in a permuting 8-row layout, perm cupy int32 (8 type_size,) -> the rows in
    the file's layout (out, or a new array)."""
    import cupy  # noqa: PLC0415

    if src.dtype != cupy.uint8 or src.ndim != 2 or not src.flags.c_contiguous:
        raise ValueError(f"unrepack_x8: need C-contiguous uint8 rows, found {src.dtype} {src.shape}")
    n_rows, row_bytes = src.shape
    if n_rows % 8 or row_bytes % type_size or perm.shape != (8 * type_size,) or perm.dtype != cupy.int32:
        raise ValueError(f"unrepack_x8: rows {src.shape} are not whole 8-row groups of {type_size}-byte blocks, or "
                         f"the permutation {perm.shape} {perm.dtype} does not fit them")
    if out is None:
        out = cupy.empty_like(src)
    n = src.size
    if n:
        ctas = min(MAX_CTAS, -(-n // THREADS))
        get_kernel("unrepack", "unrepack_x8")((ctas,), (THREADS,), (src, perm, out, np.int64(n), np.int32(row_bytes),
                                                                    np.int32(type_size)))
    return out
