"""RMS norm over rows (ggml_rms_norm followed by ggml_mul with the weight), and its per-head form for QK-norm."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(cache=True, fastmath=True, parallel=True)
def _rms_norm_rows(x, w, has_w, eps, out):
    # x (n_rows, n) f32, w (n,) f32 -> out (n_rows, n) f32; out may be x
    n_rows, n = x.shape
    for r in prange(n_rows):
        s = 0.0  # float64 sum, as ggml's ggml_float
        for j in range(n):
            v = x[r, j]
            s += v * v
        mean = np.float32(s / n)
        scale = np.float32(1.0) / np.float32(math.sqrt(mean + eps))
        if has_w:
            for j in range(n):
                out[r, j] = (x[r, j] * scale) * w[j]
        else:
            for j in range(n):
                out[r, j] = x[r, j] * scale


def _weight(w: np.ndarray | None, n: int) -> tuple[np.ndarray, bool]:
    if w is None:
        return np.zeros(1, dtype=np.float32), False
    w = np.ascontiguousarray(w, dtype=np.float32).reshape(-1)
    if w.shape[0] != n:
        raise ValueError(f"rms_norm: weight must have {n} values, found {w.shape[0]}")
    return w, True


def _out(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    if out is None:
        return np.empty(x.shape, dtype=np.float32)
    if out.shape != x.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {x.shape}, found {out.dtype} {out.shape}")
    return out


def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """x (n_tok, n) f32, w (n,) f32 or None -> x / sqrt(mean(x^2) + eps) * w, f32 (n_tok, n); out=x works in place."""
    if x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"rms_norm: x must be 2-D float32, found {x.dtype} {x.shape}")
    if out is not None and out is x and not x.flags.c_contiguous:
        raise ValueError("rms_norm: in-place needs a C-contiguous x")
    x = np.ascontiguousarray(x)
    w, has_w = _weight(w, x.shape[1])
    out = _out(x, out)
    _rms_norm_rows(x, w, has_w, np.float32(eps), out)
    return out


def rms_norm_heads(x: np.ndarray, w: np.ndarray | None, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """QK-norm: x (n_tok, n_head, head_dim) f32, w (head_dim,) f32 or None -> each head's row normed, same shape."""
    if x.dtype != np.float32 or x.ndim != 3:
        raise ValueError(f"rms_norm_heads: x must be 3-D float32, found {x.dtype} {x.shape}")
    if out is not None and out is x and not x.flags.c_contiguous:
        raise ValueError("rms_norm_heads: in-place needs a C-contiguous x")
    x = np.ascontiguousarray(x)
    out = _out(x, out)
    n_tok, n_head, head_dim = x.shape
    w, has_w = _weight(w, head_dim)
    _rms_norm_rows(x.reshape(n_tok * n_head, head_dim), w, has_w, np.float32(eps),
                   out.reshape(n_tok * n_head, head_dim))
    return out
