"""RoPE with YaRN (ggml_rope_ext's ext_factor / attn_factor / corr_dims) on the GPU, as CuPy array operations.

theta_i = p * base^(-2i/n_rot) * (freq_scale * (1 - ramp_i) + ramp_i), ramp_i = ext_factor * (1 - clamp((i - lo)
/ max(0.001, hi - lo), 0, 1)) (ggml's rope_yarn), cos and sin times attn_factor (times 1 + 0.1 ln(1/freq_scale)
when ext_factor != 0). The per-dim factors are made on the host once (`yarn_factors`) and kept by the caller, so a
decode step only launches device work (capturable in a CUDA graph).
"""

from __future__ import annotations

import math

import numpy as np


def yarn_factors(n_rot: int, base: float, freq_scale: float, yarn: tuple) -> tuple[np.ndarray, float]:
    """(per-pair angle factor (n_rot // 2,) f32, magnitude) of ggml's rope cache with YaRN (float32 math)."""
    f32 = np.float32
    ext, attn, lo, hi = (f32(v) for v in yarn)
    theta_scale = f32(np.power(f32(base), f32(-2.0) / f32(n_rot)))
    out = np.empty(n_rot // 2, dtype=np.float32)
    t = f32(1.0)
    for i in range(n_rot // 2):
        ramp = (f32(1.0) - min(f32(1.0), max(f32(0.0), (f32(i) - lo) / max(f32(0.001), hi - lo)))) * ext
        out[i] = t * (f32(freq_scale) * (f32(1.0) - ramp) + ramp)
        t = f32(t * theta_scale)
    mscale = attn * (f32(1.0) + f32(0.1) * f32(math.log(f32(1.0) / f32(freq_scale)))) if ext != 0 else attn
    return out, float(mscale)


def rope_yarn(x, positions, factors, mscale: float, mode: str):
    """x cupy f32 (n, n_head, hd), positions cupy int32 (n,), factors cupy f32 (n_rot // 2,) from yarn_factors ->
    a new rotated array (dims >= n_rot unchanged); mode "norm" (adjacent pairs) or "neox" (halves)."""
    import cupy as cp  # noqa: PLC0415

    half = factors.shape[0]
    theta = positions.astype(cp.float32)[:, None, None] * factors[None, None, :]  # (n, 1, half)
    c, s = cp.cos(theta) * np.float32(mscale), cp.sin(theta) * np.float32(mscale)
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    out = x.copy()
    i0, i1 = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if mode == "norm" else (slice(0, half),
                                                                                    slice(half, 2 * half))
    x0, x1 = x[:, :, i0], x[:, :, i1]
    out[:, :, i0] = x0 * c - x1 * s
    out[:, :, i1] = x0 * s + x1 * c
    return out
