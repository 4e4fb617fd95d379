"""Rotary position embedding as ggml's CPU rope: NORM (adjacent pairs) and NEOX (halves), optional YaRN.

Angles follow ggml_rope_cache_init in float32: theta_0 = p, theta_{i+1} = theta_i * base^(-2/n_rot), once per
position; cos/sin are cached per token and shared by all heads. Dims >= n_rot pass through unchanged.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

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


@njit(cache=True, fastmath=True, parallel=True)
def _rope_kernel(x, positions, n_rot, theta_scale, freq_scale, freq_factors, ext_factor, corr_lo, corr_hi,
                 mscale, neox, out):
    # x (n_tok, n_head, head_dim) f32, positions (n_tok,) int32 -> out, same shape; out may be x
    n_tok, n_head, head_dim = x.shape
    half = n_rot // 2
    for t in prange(n_tok):
        cos_c = np.empty(half, dtype=np.float32)
        sin_c = np.empty(half, dtype=np.float32)
        _rope_cache(positions[t], n_rot, theta_scale, freq_scale, freq_factors, ext_factor, corr_lo, corr_hi,
                    mscale, cos_c, sin_c)
        for h in range(n_head):
            for i in range(half):
                i0 = i if neox else 2 * i
                i1 = i + half if neox else 2 * i + 1
                x0 = x[t, h, i0]
                x1 = x[t, h, i1]
                out[t, h, i0] = x0 * cos_c[i] - x1 * sin_c[i]
                out[t, h, i1] = x0 * sin_c[i] + x1 * cos_c[i]
            for d in range(n_rot, head_dim):
                out[t, h, d] = x[t, h, d]


def rope_yarn_corr_dims(n_rot: int, n_ctx_orig: int, freq_base: float, beta_fast: float = 32.0,
                        beta_slow: float = 1.0) -> tuple[float, float]:
    """YaRN correction dims (low, high), as ggml_rope_yarn_corr_dims (float32 math)."""
    f32 = np.float32

    def corr_dim(beta: float) -> np.float32:
        return f32(n_rot) * f32(np.log(f32(n_ctx_orig) / (f32(beta) * f32(2.0) * f32(math.pi)))) / (
            f32(2.0) * f32(np.log(f32(freq_base))))

    return float(max(0.0, np.floor(corr_dim(beta_fast)))), float(min(n_rot - 1, np.ceil(corr_dim(beta_slow))))


def rope(x: np.ndarray, positions: np.ndarray, n_rot: int, freq_base: float, freq_scale: float = 1.0,
         mode: str = "norm", out: np.ndarray | None = None, freq_factors: np.ndarray | None = None,
         ext_factor: float = 0.0, attn_factor: float = 1.0, corr_dims: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """x (n_tok, n_head, head_dim) f32, positions (n_tok,) int -> rotated f32, same shape; out=x works in place.

    mode "norm" rotates (x[2i], x[2i+1]), "neox" rotates (x[i], x[i + n_rot/2]), with
    theta_i = p * freq_scale * freq_base^(-2i/n_rot) / freq_factors[i]; ext_factor != 0 turns YaRN on
    (corr_dims from rope_yarn_corr_dims), attn_factor scales cos and sin.
    """
    if mode not in ROPE_MODES:
        raise ValueError(f"rope: mode must be one of {sorted(ROPE_MODES)}, found {mode!r}")
    if x.dtype != np.float32 or x.ndim != 3:
        raise ValueError(f"rope: x must be 3-D float32 (n_tok, n_head, head_dim), found {x.dtype} {x.shape}")
    n_tok, _, head_dim = x.shape
    if n_rot % 2 or not 0 < n_rot <= head_dim:
        raise ValueError(f"rope: n_rot must be even and in (0, {head_dim}], found {n_rot}")
    positions = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
    if positions.shape[0] != n_tok:
        raise ValueError(f"rope: need {n_tok} positions, found {positions.shape[0]}")
    if freq_factors is None:
        freq_factors = np.ones(n_rot // 2, dtype=np.float32)
    freq_factors = np.ascontiguousarray(freq_factors, dtype=np.float32).reshape(-1)
    if freq_factors.shape[0] < n_rot // 2:
        raise ValueError(f"rope: freq_factors needs {n_rot // 2} values, found {freq_factors.shape[0]}")
    if out is None:
        out = np.empty(x.shape, dtype=np.float32)
    elif out.shape != x.shape or out.dtype != np.float32:
        raise ValueError(f"rope: out must be float32 {x.shape}, found {out.dtype} {out.shape}")
    f32 = np.float32
    theta_scale = f32(np.power(f32(freq_base), f32(-2.0) / f32(n_rot)))  # powf(freq_base, -2.0f/n_dims)
    _rope_kernel(x, positions, n_rot, theta_scale, f32(freq_scale), freq_factors, f32(ext_factor),
                 f32(corr_dims[0]), f32(corr_dims[1]), f32(attn_factor), mode == "neox", out)
    return out
