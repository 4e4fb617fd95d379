"""What the 8-row interleaved layouts (legacy_x8, q4_k_x8, q8_0_x8, mxfp4_x8, iq4_xs_x8) share: a matrix is
interleaved in whole groups of 8 rows, each group's blocks rewritten by the layout's own compiled loop."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

ROWS = 8  # rows a group


def repackable(shape: tuple[int, ...], block: int) -> bool:
    """Whether a matrix of numpy shape (n_out, n_in) of `block`-element blocks can be interleaved: whole groups of
    8 rows."""
    return len(shape) == 2 and shape[0] > 0 and shape[0] % ROWS == 0 and shape[1] % block == 0


def interleave(raw: np.ndarray, what: str, block: int, row_block: int, out_row_block: int,
               groups: Callable) -> np.ndarray:
    """Rows uint8 (n_out, nb * row_block) of a type of `block`-element blocks -> uint8 (n_out, nb * out_row_block),
    made by groups(src flat, nb, dst flat) (the layout's compiled loop, groups in parallel); `what` names the matrix
    in the error ("a Q4_K", "an MXFP4")."""
    n_out, rb = raw.shape
    nb = rb // row_block
    if not repackable((n_out, nb * block), block) or rb != nb * row_block:
        raise ValueError(f"cannot interleave {what} matrix of {n_out} rows of {rb} bytes (8-row groups needed)")
    out = np.empty((n_out, nb * out_row_block), dtype=np.uint8)
    groups(np.ascontiguousarray(raw).reshape(-1), nb, out.reshape(-1))
    return out
