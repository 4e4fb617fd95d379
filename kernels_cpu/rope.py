"""Rotary position embedding as ggml's CPU rope: NORM (adjacent pairs) and NEOX (halves), optional YaRN.

Angles follow ggml_rope_cache_init in float32: theta_0 = p, theta_{i+1} = theta_i * base^(-2/n_rot), once per
position; cos/sin tables (`rope_tables`) are computed once per token and shared by all heads (and, in the
CPU backend, by every layer at the same positions). Dims >= n_rot pass through unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from .norm import SERIAL_MAX_ELEMS

ROPE_MODES = {"norm": 0, "neox": 1}


@njit(cache=True, fastmath=True)
def _rope_cache(p, n_rot, theta_scale, freq_scale, freq_factors, ext_factor, corr_lo, corr_hi, mscale, cos_c, sin_c):
    # cos/sin (n_rot // 2,) f32 of position p, as ggml_rope_cache_init + rope_yarn
    theta = np.float32(p)
    for i in range(n_rot // 2):
        theta_extrap = theta / freq_factors[i]
        th = freq_scale * theta_extrap
        ms = mscale
        if ext_factor != 0:
            y = (np.float32(i) - corr_lo) / max(np.float32(0.001), corr_hi - corr_lo)
            ramp_mix = (np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), y))) * ext_factor
            th = th * (np.float32(1.0) - ramp_mix) + theta_extrap * ramp_mix
            ms *= np.float32(1.0) + np.float32(0.1) * np.float32(math.log(np.float32(1.0) / freq_scale))
        cos_c[i] = np.cos(th) * ms
        sin_c[i] = np.sin(th) * ms
        theta = theta * theta_scale


@njit(cache=True, fastmath=True)
def _rope_tables(positions, n_rot, theta_scale, freq_scale, freq_factors, ext_factor, corr_lo, corr_hi, mscale,
                 cos_t, sin_t):
    # cos_t, sin_t (n_tok, n_rot // 2) f32: the cache of every position
    for t in range(positions.shape[0]):
        _rope_cache(positions[t], n_rot, theta_scale, freq_scale, freq_factors, ext_factor, corr_lo, corr_hi,
                    mscale, cos_t[t], sin_t[t])


@njit(inline="always", fastmath=True)
def _rope_token(x, cos_t, sin_t, n_rot, neox, out, t):
    n_head, head_dim = x.shape[1], x.shape[2]
    half = n_rot // 2
    for h in range(n_head):
        for i in range(half):
            i0 = i if neox else 2 * i
            i1 = i + half if neox else 2 * i + 1
            x0 = x[t, h, i0]
            x1 = x[t, h, i1]
            out[t, h, i0] = x0 * cos_t[t, i] - x1 * sin_t[t, i]
            out[t, h, i1] = x0 * sin_t[t, i] + x1 * cos_t[t, i]
        for d in range(n_rot, head_dim):
            out[t, h, d] = x[t, h, d]


@njit(cache=True, fastmath=True, parallel=True)
def _rope_apply_par(x, cos_t, sin_t, n_rot, neox, out):
    # x (n_tok, n_head, head_dim) f32 rotated by the per-token tables -> out, same shape; out may be x
    for t in prange(x.shape[0]):
        _rope_token(x, cos_t, sin_t, n_rot, neox, out, t)


@njit(cache=True, fastmath=True)
def _rope_apply_serial(x, cos_t, sin_t, n_rot, neox, out):
    for t in range(x.shape[0]):
        _rope_token(x, cos_t, sin_t, n_rot, neox, out, t)


@njit(cache=True)
def rope_apply_rows(x, cos_t, sin_t, n_rot, neox, out):
    """x (n_tok, n_head, head_dim) f32 rotated by per-token tables -> out (may be x): one token (decode) on the
    calling thread, larger x in parallel. The one place that choice is made, for rope_apply and for compiled
    callers (kernels_cpu.fused_layer) alike: with fast-math the two forms may round apart."""
    if x.size <= SERIAL_MAX_ELEMS:
        _rope_apply_serial(x, cos_t, sin_t, n_rot, neox, out)
    else:
        _rope_apply_par(x, cos_t, sin_t, n_rot, neox, out)


def rope_yarn_corr_dims(n_rot: int, n_ctx_orig: int, freq_base: float, beta_fast: float = 32.0,
                        beta_slow: float = 1.0) -> tuple[float, float]:
    """YaRN correction dims (low, high), as ggml_rope_yarn_corr_dims (float32 math)."""
    f32 = np.float32

    def corr_dim(beta: float) -> np.float32:
        return f32(n_rot) * f32(np.log(f32(n_ctx_orig) / (f32(beta) * f32(2.0) * f32(math.pi)))) / (
            f32(2.0) * f32(np.log(f32(freq_base))))

    return float(max(0.0, np.floor(corr_dim(beta_fast)))), float(min(n_rot - 1, np.ceil(corr_dim(beta_slow))))


@dataclass(frozen=True)
class RopeTables:
    """cos/sin (n_tok, n_rot // 2) f32 of a batch's positions: computed once, applied to every head and layer
    that shares the positions and the frequency parameters."""

    cos: np.ndarray
    sin: np.ndarray
    n_rot: int


def rope_tables(positions: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0,
                freq_factors: np.ndarray | None = None, ext_factor: float = 0.0, attn_factor: float = 1.0,
                corr_dims: tuple[float, float] = (0.0, 0.0)) -> RopeTables:
    """The rotation angles' cos/sin for `positions` (see `rope` for the parameters)."""
    if n_rot % 2 or n_rot <= 0:
        raise ValueError(f"rope: n_rot must be even and > 0, found {n_rot}")
    positions = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
    if freq_factors is None:
        freq_factors = np.ones(n_rot // 2, dtype=np.float32)
    freq_factors = np.ascontiguousarray(freq_factors, dtype=np.float32).reshape(-1)
    if freq_factors.shape[0] < n_rot // 2:
        raise ValueError(f"rope: freq_factors needs {n_rot // 2} values, found {freq_factors.shape[0]}")
    f32 = np.float32
    theta_scale = f32(np.power(f32(freq_base), f32(-2.0) / f32(n_rot)))  # powf(freq_base, -2.0f/n_dims)
    cos_t = np.empty((positions.shape[0], n_rot // 2), dtype=np.float32)
    sin_t = np.empty_like(cos_t)
    _rope_tables(positions, n_rot, theta_scale, f32(freq_scale), freq_factors, f32(ext_factor), f32(corr_dims[0]),
                 f32(corr_dims[1]), f32(attn_factor), cos_t, sin_t)
    return RopeTables(cos_t, sin_t, n_rot)


def rope_apply(x: np.ndarray, tables: RopeTables, mode: str = "norm", out: np.ndarray | None = None) -> np.ndarray:
    """x (n_tok, n_head, head_dim) f32 rotated by `tables` (of the same n_tok positions); out=x works in place."""
    if mode not in ROPE_MODES:
        raise ValueError(f"rope: mode must be one of {sorted(ROPE_MODES)}, found {mode!r}")
    if x.dtype != np.float32 or x.ndim != 3:
        raise ValueError(f"rope: x must be 3-D float32 (n_tok, n_head, head_dim), found {x.dtype} {x.shape}")
    if not tables.n_rot <= x.shape[2]:
        raise ValueError(f"rope: n_rot must be even and in (0, {x.shape[2]}], found {tables.n_rot}")
    if tables.cos.shape[0] != x.shape[0]:
        raise ValueError(f"rope: need {x.shape[0]} positions, found {tables.cos.shape[0]}")
    if out is None:
        out = np.empty(x.shape, dtype=np.float32)
    elif out.shape != x.shape or out.dtype != np.float32:
        raise ValueError(f"rope: out must be float32 {x.shape}, found {out.dtype} {out.shape}")
    rope_apply_rows(x, tables.cos, tables.sin, tables.n_rot, mode == "neox", out)
    return out


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0,
         mode: str = "norm", out: np.ndarray | None = None, freq_factors: np.ndarray | None = None,
         ext_factor: float = 0.0, attn_factor: float = 1.0, corr_dims: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """x (n_tok, n_head, head_dim) f32, positions (n_tok,) int -> rotated f32, same shape; out=x works in place.

    mode "norm" rotates (x[2i], x[2i+1]), "neox" rotates (x[i], x[i + n_rot/2]), with
    theta_i = p * freq_scale * freq_base^(-2i/n_rot) / freq_factors[i]; ext_factor != 0 turns YaRN on
    (corr_dims from rope_yarn_corr_dims), attn_factor scales cos and sin.
    """
    # mode, n_rot and x are checked by rope_tables / rope_apply; x's shape first, as the positions need it
    if x.dtype != np.float32 or x.ndim != 3:
        raise ValueError(f"rope: x must be 3-D float32 (n_tok, n_head, head_dim), found {x.dtype} {x.shape}")
    positions = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"rope: need {x.shape[0]} positions, found {positions.shape[0]}")
    tables = rope_tables(positions, n_rot, freq_base, freq_scale, freq_factors, ext_factor, attn_factor, corr_dims)
    return rope_apply(x, tables, mode, out)
