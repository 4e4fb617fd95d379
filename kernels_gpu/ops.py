"""Launchers of ops.cu: rms_norm (rows, per head), add_rms_norm (residual add + norm), rope (NORM / NEOX), glu (silu / gelu), scale; cupy float32."""

from __future__ import annotations

import numpy as np

from .module import get_kernel

ROPE_MODES = {"norm": 0, "neox": 1}
GLU_ACTS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}  # glu_act in common.cu
GLU_VEC_MIN = 1 << 16  # glu of this many values or more (a multiple of 4) runs glu_f32x4; 0 turns it off


def _f32(name: str, x, ndim: int | None = None):
    import cupy  # noqa: PLC0415

    if not isinstance(x, cupy.ndarray):
        raise ValueError(f"{name}: expected a cupy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise ValueError(f"{name}: expected float32, found {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, found shape {x.shape}")
    return cupy.ascontiguousarray(x)


def _rms_rows(x2, w, eps: float, out2, add=None, q8=None) -> None:
    """out2 = rms_norm(x2) * w; with add = (a2, sum2): sum2 = x2 + a2 first and out2 = rms_norm(sum2) * w; with
    q8 = (xq, xm), out2's quantize_q8_1 bytes too (rows that take the vec kernels only: _vec_rows)."""
    n_rows, n = x2.shape
    if n_rows == 0 or n == 0:
        return
    w_arg = np.uint64(0) if w is None else w
    vec = _vec_rows(n, [x2, out2] + ([] if w is None else [w]) + ([] if add is None else list(add)))
    if vec is not None:  # a CTA a row, its values in registers (rms_row_vec)
        v, threads = vec
        q = "" if q8 is None else "_q8"
        if add is None:
            fn, args = get_kernel("ops", f"rms_norm{q}_vec{v}_f32"), (x2, w_arg, out2)
        else:
            fn, args = get_kernel("ops", f"add_rms_norm{q}_vec{v}_f32"), (x2, add[0], w_arg, add[1], out2)
        fn((n_rows,), (threads, 1), (*args, np.int32(n), np.float32(eps), *(() if q8 is None else q8)))
        return
    if q8 is not None:  # rms_norm_q8 checks _vec_rows before it asks
        raise ValueError(f"rms_norm with q8: rows of {n} values take no one-CTA-a-row kernel")
    if add is None:
        fn, args = get_kernel("ops", "rms_norm_f32"), (x2, w_arg, out2)
    else:
        fn, args = get_kernel("ops", "add_rms_norm_f32"), (x2, add[0], w_arg, add[1], out2)
    if n >= 1024:  # a CTA per row: 1024 threads from 4096 values (fewer dependent loads a thread), else 256
        threads = 1024 if n >= 4096 else 256
        fn((n_rows,), (threads, 1), (*args, np.int32(n_rows), np.int32(n), np.float32(eps)))
    else:  # a warp per row, 8 rows per CTA
        fn(((n_rows + 7) // 8,), (32, 8), (*args, np.int32(n_rows), np.int32(n), np.float32(eps)))


def _vec_rows(n: int, arrays: list) -> tuple[int, int] | None:
    """(V, threads) of rms_norm_vec{V}_f32 for rows of n values: n = 4 V threads with threads a multiple of 32 up
    to 1024 and V in 1, 2, 4, 8, from n = 1024 on (shorter rows take a warp each), every array 16-byte aligned;
    else None (rms_norm_f32)."""
    if n < 1024 or n % 128 or any(a.data.ptr % 16 for a in arrays):
        return None
    for v in (1, 2, 4, 8):
        threads = n // (4 * v)
        if threads <= 1024 and threads % 32 == 0 and 4 * v * threads == n:
            return v, threads
    return None


def _weight(w, n: int, name: str):
    import cupy  # noqa: PLC0415

    if w is None:
        return None
    if not isinstance(w, cupy.ndarray):
        w = cupy.asarray(np.ascontiguousarray(w, dtype=np.float32))  # a host weight (not uploaded): copy it
    w = cupy.ascontiguousarray(w, dtype=cupy.float32).reshape(-1)
    if w.shape[0] != n:
        raise ValueError(f"{name}: weight must have {n} values, found {w.shape[0]}")
    return w


def rms_norm(x, w, eps: float, out=None):
    """x (n_tok, n) f32, w (n,) f32 or None -> x / sqrt(mean(x^2) + eps) * w, (n_tok, n); out may be x."""
    import cupy  # noqa: PLC0415

    x = _f32("rms_norm", x, 2)
    w = _weight(w, x.shape[1], "rms_norm")
    out = cupy.empty_like(x) if out is None else out
    _rms_rows(x, w, eps, out)
    return out


def rms_norm_q8(x, w, eps: float, a=None):
    """rms_norm(x, w, eps) (a None) or add_rms_norm(x, a, w, eps), with the normed rows also quantized as
    quantize_q8_1 does (the same bytes), in one kernel: -> (out, (xq, xm)), or (x + a, out, (xq, xm)) with a.
    None where the rows do not take the one-CTA-a-row kernels (n >= 1024, n % 128 == 0, 16-byte aligned)."""
    import cupy  # noqa: PLC0415

    from .matmul import q8_empty  # noqa: PLC0415

    x = _f32("rms_norm_q8", x, 2)
    if a is not None:
        a = _f32("rms_norm_q8", a, 2)
        if a.shape != x.shape:
            raise ValueError(f"add_rms_norm: x {x.shape} and a {a.shape} differ in shape")
    n_rows, n = x.shape
    w = _weight(w, n, "rms_norm_q8")
    # checked before anything is allocated (the outputs are new, so aligned): most calls of a small model end here
    if n_rows == 0 or _vec_rows(n, [x] + ([] if w is None else [w]) + ([] if a is None else [a])) is None:
        return None
    out = cupy.empty_like(x)
    total = None if a is None else cupy.empty_like(x)
    q8 = q8_empty(n_rows, n)
    _rms_rows(x, w, eps, out, None if a is None else (a, total), q8)
    return (out, q8) if a is None else (total, out, q8)


def add_rms_norm(x, a, w, eps: float):
    """The residual add and the next norm in one kernel: x, a (n_tok, n) f32, w (n,) f32 or None ->
    (x + a, rms_norm(x + a) * w), both new arrays; the norm equals rms_norm's of the sum exactly."""
    import cupy  # noqa: PLC0415

    x, a = _f32("add_rms_norm", x, 2), _f32("add_rms_norm", a, 2)
    if a.shape != x.shape:
        raise ValueError(f"add_rms_norm: x {x.shape} and a {a.shape} differ in shape")
    w = _weight(w, x.shape[1], "add_rms_norm")
    total, out = cupy.empty_like(x), cupy.empty_like(x)
    _rms_rows(x, w, eps, out, add=(a, total))
    return total, out


def rms_norm_heads(x, w, eps: float, out=None):
    """QK-norm: x (n_tok, n_head, head_dim) f32, w (head_dim,) -> each head's row normed, same shape."""
    import cupy  # noqa: PLC0415

    x = _f32("rms_norm_heads", x, 3)
    n_tok, n_head, hd = x.shape
    w = _weight(w, hd, "rms_norm_heads")
    out = cupy.empty_like(x) if out is None else out
    _rms_rows(x.reshape(n_tok * n_head, hd), w, eps, out.reshape(n_tok * n_head, hd))
    return out


def _rope_mode(name: str, mode: str) -> None:
    if mode not in ROPE_MODES:
        raise ValueError(f"{name}: mode must be one of {sorted(ROPE_MODES)}, found {mode!r}")


def _rope_theta(name: str, n_rot: int, hd: int, positions, n_tok: int, freq_base: float) -> np.float32:
    """A RoPE launch's checks of n_rot and positions (cupy int32 (n_tok,)) -> its theta scale,
    freq_base^(-2 / n_rot) in float32 (rope_f32, rope_qk_f32 and qk_norm_rope_f32 take the same)."""
    import cupy  # noqa: PLC0415

    if n_rot % 2 or not 0 < n_rot <= hd:
        raise ValueError(f"{name}: n_rot must be even and in (0, {hd}], found {n_rot}")
    if not isinstance(positions, cupy.ndarray) or positions.dtype != cupy.int32 or positions.shape != (n_tok,):
        raise ValueError(f"{name}: positions must be a cupy int32 array of shape ({n_tok},)")
    return np.float32(np.power(np.float32(freq_base), np.float32(-2.0) / np.float32(n_rot)))


def rope(x, positions, n_rot: int, freq_base: float, freq_scale: float = 1.0, mode: str = "norm"):
    """In place on a contiguous x (n_tok, n_head, head_dim) f32 (copied first if not contiguous); positions:
    cupy int32 (n_tok,). theta_i = p * freq_scale * freq_base^(-2i/n_rot). Returns the rotated array."""
    _rope_mode("rope", mode)
    x = _f32("rope", x, 3)
    n_tok, n_head, hd = x.shape
    theta_scale = _rope_theta("rope", n_rot, hd, positions, n_tok, freq_base)
    total = n_tok * n_head * (n_rot // 2)
    if total == 0:
        return x
    fn = get_kernel("ops", "rope_f32")
    fn(((total + 255) // 256,), (256,), (x, positions, np.int32(n_tok), np.int32(n_head), np.int32(hd),
                                        np.int32(n_rot), theta_scale, np.float32(freq_scale),
                                        np.int32(ROPE_MODES[mode])))
    return x


def rope_qk(q, k, positions, n_rot: int, freq_base: float, freq_scale: float = 1.0, mode: str = "norm"):
    """rope of q (n_tok, n_head, hd) and k (n_tok, n_head_kv, hd) in one launch, in place (contiguous f32; copied
    first if not): equal to rope(q, ...) and rope(k, ...) exactly. Returns (q, k)."""
    _rope_mode("rope_qk", mode)
    q, k = _f32("rope_qk", q, 3), _f32("rope_qk", k, 3)
    n_tok, n_head, hd = q.shape
    if k.shape[0] != n_tok or k.shape[2] != hd:
        raise ValueError(f"rope_qk: q {q.shape} and k {k.shape} need one token count and one head_dim")
    theta_scale = _rope_theta("rope_qk", n_rot, hd, positions, n_tok, freq_base)
    total = n_tok * (n_head + k.shape[1]) * (n_rot // 2)
    if total == 0:
        return q, k
    get_kernel("ops", "rope_qk_f32")(((total + 255) // 256,), (256,), (
        q, k, positions, np.int32(n_tok), np.int32(n_head), np.int32(k.shape[1]), np.int32(hd), np.int32(n_rot),
        theta_scale, np.float32(freq_scale), np.int32(ROPE_MODES[mode])))
    return q, k


QKNR_MAX_D = 256  # head_dim at most (qk_norm_rope_f32's shared rows)


def qk_norm_rope(q, k, wq, wk, eps: float, positions, n_rot: int, freq_base: float, freq_scale: float = 1.0,
                 mode: str = "norm"):
    """rms_norm_heads of q and k (weights wq, wk (head_dim,) f32) then rope of both, in one launch and in place
    (q (n_tok, n_head, hd), k (n_tok, n_head_kv, hd) contiguous f32; copied first if not): equal to the four calls.
    Returns (q, k)."""
    _rope_mode("qk_norm_rope", mode)
    q, k = _f32("qk_norm_rope", q, 3), _f32("qk_norm_rope", k, 3)
    n_tok, n_head, hd = q.shape
    if k.shape[0] != n_tok or k.shape[2] != hd or hd > QKNR_MAX_D:
        raise ValueError(f"qk_norm_rope: q {q.shape} and k {k.shape} need one token count and head_dim <= "
                         f"{QKNR_MAX_D}")
    theta_scale = _rope_theta("qk_norm_rope", n_rot, hd, positions, n_tok, freq_base)
    if wq is None or wk is None:
        raise ValueError("qk_norm_rope: needs both norm weights")
    wq, wk = _weight(wq, hd, "qk_norm_rope"), _weight(wk, hd, "qk_norm_rope")
    rows = n_tok * (n_head + k.shape[1])
    if rows == 0:
        return q, k
    get_kernel("ops", "qk_norm_rope_f32")(((rows + 7) // 8,), (32, 8), (
        q, k, wq, wk, positions, np.int32(n_tok), np.int32(n_head), np.int32(k.shape[1]), np.int32(hd),
        np.float32(eps), np.int32(n_rot), theta_scale, np.float32(freq_scale), np.int32(ROPE_MODES[mode])))
    return q, k


def _grid(n: int) -> tuple[int]:
    return (max(1, min((n + 255) // 256, 132 * 16)),)


def glu(gate, up, act: str = "silu", out=None, vec: bool | None = None):
    """act(gate) * up, f32, any shape (gate and up alike); act "silu", "gelu" (tanh approximation) or "swiglu_oai"
    (gpt-oss's clamped SwiGLU: min(gate, 7) * sigmoid(1.702 min(gate, 7)) * (clamp(up, -7, 7) + 1)).
    vec: True / False force glu_f32x4 / glu_f32 (same results); None picks glu_f32x4 from GLU_VEC_MIN values."""
    import cupy  # noqa: PLC0415

    if act not in GLU_ACTS:
        raise ValueError(f"glu: act must be one of {sorted(GLU_ACTS)}, found {act!r}")
    gate, up = _f32("glu gate", gate), _f32("glu up", up)
    if gate.shape != up.shape:
        raise ValueError(f"glu: gate and up must have one shape, found {gate.shape} and {up.shape}")
    out = cupy.empty_like(gate) if out is None else out
    n = gate.size
    if vec is None:
        vec = 0 < GLU_VEC_MIN <= n
    if vec and n % 4 == 0 and all(a.data.ptr % 16 == 0 for a in (gate, up, out)) and out.flags.c_contiguous:
        n4 = n // 4
        get_kernel("ops", "glu_f32x4")(((n4 + 255) // 256,), (256,), (gate, up, out, np.int64(n4),
                                                                     np.int32(GLU_ACTS[act])))
    elif n:
        get_kernel("ops", "glu_f32")(_grid(gate.size), (256,), (gate, up, out, np.int64(gate.size),
                                                                np.int32(GLU_ACTS[act])))
    return out


def scale(x, s: float, out=None):
    """x * s, f32, any shape."""
    import cupy  # noqa: PLC0415

    x = _f32("scale", x)
    out = cupy.empty_like(x) if out is None else out
    if x.size:
        get_kernel("ops", "scale_f32")(_grid(x.size), (256,), (x, out, np.int64(x.size), np.float32(s)))
    return out


def argmax_rows(x, out=None):
    """x (n_rows, n) f32 -> each row's argmax as float32 (n_rows,) (exact ids below 2^24): np.argmax's choice among
    equal values (the lowest index); NaNs never win (a row without a number larger than -inf gives 0). out: a
    float32 (n_rows,) view to write (e.g. the head of a step's output buffer)."""
    import cupy  # noqa: PLC0415

    x = _f32("argmax_rows", x, 2)
    n_rows, n = x.shape
    if n >= 1 << 24:
        raise ValueError(f"argmax_rows: rows of {n} values have ids a float32 cannot hold exactly")
    out = cupy.empty(n_rows, dtype=cupy.float32) if out is None else out
    if n_rows:
        get_kernel("ops", "argmax_rows_f32")((n_rows,), (1024,), (x, out, np.int32(n)))
    return out
