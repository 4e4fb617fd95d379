"""RMS norm over rows (ggml_rms_norm followed by ggml_mul with the weight), and its per-head form for QK-norm."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


# Below this many elements a call runs on the calling thread: waking the workers costs more than the work
# (decode: one token's 640-4096 values).
SERIAL_MAX_ELEMS = 16384


# No fast-math in the norms: ggml's order (float32 squares added one by one into a float64 sum, then 1 / sqrtf),
# and the same code whether Numba compiles it afresh or loads it from its cache (with fast-math the two differed:
# on a synthetic Qwen2 Q4_K_M, top-1 agreement with llama.cpp 0.922 freshly compiled, 0.951 from the cache).
@njit(inline="always")
def _norm_row(x, w, has_w, eps, out, r):
    n = x.shape[1]
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


@njit(cache=True, parallel=True)
def _rms_norm_rows_par(x, w, has_w, eps, out):
    # x (n_rows, n) f32, w (n,) f32 -> out (n_rows, n) f32; out may be x
    for r in prange(x.shape[0]):
        _norm_row(x, w, has_w, eps, out, r)


@njit(cache=True)
def _rms_norm_rows_serial(x, w, has_w, eps, out):
    for r in range(x.shape[0]):
        _norm_row(x, w, has_w, eps, out, r)


@njit(cache=True)
def rms_norm_rows(x, w, has_w, eps, out):
    """x (n_rows, n) f32 C-contiguous, w (n,) f32 (ignored unless has_w), eps f32 -> out (may be x): the serial form
    for a small x, the parallel one above SERIAL_MAX_ELEMS. The one place that choice is made, for rms_norm and for
    compiled callers (kernels_cpu.fused_layer) alike: compiled apart, the two forms need not give the same bits."""
    if x.size <= SERIAL_MAX_ELEMS:
        _rms_norm_rows_serial(x, w, has_w, eps, out)
    else:
        _rms_norm_rows_par(x, w, has_w, eps, out)


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
    rms_norm_rows(x, w, has_w, np.float32(eps), out)
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
    rms_norm_rows(x.reshape(n_tok * n_head, head_dim), w, has_w, np.float32(eps),
                   out.reshape(n_tok * n_head, head_dim))
    return out
