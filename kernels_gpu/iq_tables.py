"""The CUDA source text of the IQ types' constant tables (grids and ksigns_iq2xs), made from gguf_io.iq_grids so that
the CPU and the GPU read one copy of the data; kernels_gpu.module prepends it to matvec_iq.cu as "iq_grids.cu".

Tables follow ggml-common.h: each grid entry packs its 8 (iq2, iq1) or 4 (iq3) byte values little-endian in a u64 or
u32 (iq1s_grid's values -1, 0, 1 as int8 bytes).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from gguf_io import iq_grids


def _table(ctype: str, name: str, values: np.ndarray, per_line: int) -> str:
    width = 16 if ctype == "u64" else (8 if ctype == "u32" else 2)
    suffix = "ull" if ctype == "u64" else ("u" if ctype == "u32" else "")
    items = [f"0x{int(v):0{width}x}{suffix}" for v in values]
    lines = [", ".join(items[i:i + per_line]) for i in range(0, len(items), per_line)]
    body = ",\n    ".join(lines)
    return f"static __device__ const {ctype} {name}[{len(items)}] = {{\n    {body}}};\n"


def _packed(grid: np.ndarray, dtype: str) -> np.ndarray:
    """(n, k) bytes -> (n,) little-endian words of k bytes."""
    return np.ascontiguousarray(grid).view(np.uint8).reshape(grid.shape[0], -1).copy().view(dtype)[:, 0]


@cache
def cuda_source() -> str:
    """`static __device__ const` definitions of iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid, iq3s_grid,
    iq1s_grid and ksigns_iq2xs."""
    g = iq_grids
    parts = ["// iq_grids.cu: made by kernels_gpu/iq_tables.py from gguf_io/iq_grids.py (ggml-common.h's tables)\n",
             _table("u64", "iq2xxs_grid", _packed(g.IQ2XXS_GRID, "<u8"), 4),
             _table("u64", "iq2xs_grid", _packed(g.IQ2XS_GRID, "<u8"), 4),
             _table("u64", "iq2s_grid", _packed(g.IQ2S_GRID, "<u8"), 4),
             _table("u32", "iq3xxs_grid", _packed(g.IQ3XXS_GRID, "<u4"), 8),
             _table("u32", "iq3s_grid", _packed(g.IQ3S_GRID, "<u4"), 8),
             _table("u64", "iq1s_grid", _packed(g.IQ1S_GRID, "<u8"), 4),
             _table("u8", "ksigns_iq2xs", g.KSIGNS_IQ2XS, 16)]
    return "\n".join(parts)
