"""Elementwise activations (silu, gelu-tanh, softcap), the fused GLUs (swiglu, geglu) and row softmax.

Formulas are ggml's (ggml_silu_f32, ggml_gelu_f32). ggml's CPU gelu/geglu go through an fp16 table
(GGML_GELU_FP16); `f16_table=True` reproduces that, the default computes the float32 formula.
The exp of silu, gelu's formula and swiglu_oai is `exp_f32` (a float64 polynomial rounded once: expf's values but
at near-ties): the elementwise loops then vectorize instead of calling libm's expf per element.
Inputs of any shape (C-contiguous float32); `out` may be the input for in-place use.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kv_cache import F16_TO_F32, f32_to_f16_bits

GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)




# The float flags of the code that inlines exp_f32: fastmath without reassociation, which would fold its two-part
# ln 2 back into one constant (errors of thousands of ulps), and without approximate reciprocals, with which a
# vectorized division (a reciprocal and a Newton step) and the scalar one of a loop's tail rounded apart.
# error_model "numpy": a float division raises nothing, so the loops over elements vectorize (1 + exp(-x) > 0).
FAST = {"nnan", "ninf", "nsz", "contract", "afn"}
_LOG2E = 1.4426950408889634
_LN2_HI = 0.6931471803691238  # 0x3fe62e42fee00000: n * _LN2_HI is exact for |n| < 2**11
_LN2_LO = 1.9082149292705877e-10  # ln 2 - _LN2_HI
_INV_FACT = tuple(1.0 / np.prod(np.arange(1.0, k + 1.0)) for k in range(13))  # 1 / k!, k = 0..12


@njit(inline="always", fastmath=FAST)
def exp_f32(x):
    """exp(x) of a float32 without a libm call, so that loops over it vectorize: in float64, x = n ln 2 + r
    (Cody-Waite, |r| <= ln 2 / 2), Taylor to r^12 (relative error below 2e-16), times 2^n through the exponent
    field, then rounded once to float32: the correctly rounded expf but where exp(x) lies within ~1e-15 of a
    rounding midpoint (libm's expf: within 0.502 ulp). 0 below -103.9; it saturates at exp(88.7) ~ 3.3e38
    instead of overflowing (FAST assumes no inf: an inf divisor went through a reciprocal's Newton step to nan).
    Callers compile it with FAST, never with reassociation."""
    xd = min(max(np.float64(x), -104.0), 88.7)
    n = np.floor(xd * _LOG2E + 0.5)
    r = (xd - n * _LN2_HI) - n * _LN2_LO
    p = _INV_FACT[12]
    for k in range(11, -1, -1):
        p = p * r + _INV_FACT[k]
    return np.float32(p * np.int64((np.int64(n) + 1023) << 52).view(np.float64))


@njit(inline="always", fastmath=FAST)
def _silu(x):
    return x / (np.float32(1.0) + exp_f32(-x))


@njit(inline="always", fastmath=FAST)
def _gelu(x):
    # ggml_gelu_f32's 0.5 x (1 + tanh(u)), written as x / (1 + exp(-2u)) (equal; exp is ~10x cheaper than tanhf)
    u = np.float32(0.79788456080286535587989211986876) * x * (np.float32(1.0) + np.float32(0.044715) * x * x)
    return x / (np.float32(1.0) + exp_f32(np.float32(-2.0) * u))


def _gelu_f16_table() -> np.ndarray:
    # ggml_table_gelu_f16[h] = fp16(gelu(fp32(h))), kept as float32 values
    x, one, half = F16_TO_F32, np.float32(1.0), np.float32(0.5)
    with np.errstate(over="ignore", invalid="ignore"):
        g = half * x * (one + np.tanh(SQRT_2_OVER_PI * x * (one + GELU_COEF_A * x * x)))
        return g.astype(np.float16).astype(np.float32)


GELU_F16_TABLE = _gelu_f16_table()


@njit(cache=True)
def _gelu_table(x, table):
    # ggml_vec_gelu_f32 with GGML_GELU_FP16 (no fastmath: the fp16 rounding must be exact)
    if x <= np.float32(-10.0):
        return np.float32(0.0)
    if x >= np.float32(10.0):
        return x
    return table[f32_to_f16_bits(x)]


@njit(cache=True, fastmath=FAST, error_model="numpy", parallel=True)
def _unary(x, op, cap, table, out):
    # x, out f32 (n,); op 0 silu, 1 gelu, 2 gelu via fp16 table, 3 softcap
    for i in prange(x.shape[0]):
        v = x[i]
        if op == 0:
            out[i] = _silu(v)
        elif op == 1:
            out[i] = _gelu(v)
        elif op == 2:
            out[i] = _gelu_table(v, table)
        else:
            out[i] = cap * np.tanh(v / cap)


SWIGLU_OAI_ALPHA = np.float32(1.702)  # llama.cpp's build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE (hard-coded there)
SWIGLU_OAI_LIMIT = np.float32(7.0)


@njit(inline="always", fastmath=FAST)
def _swiglu_oai(g, u):
    # ggml_compute_forward_swiglu_oai_f32: x = min(g, limit), y = clamp(u, -limit, limit), x sigmoid(alpha x) (y + 1)
    x = min(g, SWIGLU_OAI_LIMIT)
    y = min(max(u, -SWIGLU_OAI_LIMIT), SWIGLU_OAI_LIMIT)
    return x / (np.float32(1.0) + exp_f32(-SWIGLU_OAI_ALPHA * x)) * (y + np.float32(1.0))


@njit(inline="always", fastmath=FAST)
def _glu_one(gate, up, op, table, out, i):
    # op 0 silu, 1 gelu, 2 gelu via the fp16 table (op 3, swiglu_oai, has loops of its own: a fourth branch in this
    # body changed how LLVM compiled the others' loops, and with them the last bit of a few results)
    g = gate[i]
    if op == 0:
        a = _silu(g)
    elif op == 1:
        a = _gelu(g)
    else:
        a = _gelu_table(g, table)
    out[i] = a * up[i]


@njit(cache=True, fastmath=FAST, error_model="numpy", parallel=True)
def _glu_par(gate, up, op, table, out):
    # gate, up, out f32 (n,): out = act(gate) * up; op 0 silu, 1 gelu, 2 gelu via fp16 table, 3 swiglu_oai
    if op == 0:  # a loop of its own: no branch in its body, so it vectorizes (exp_f32)
        for i in prange(gate.shape[0]):
            out[i] = _silu(gate[i]) * up[i]
    elif op == 3:
        for i in prange(gate.shape[0]):
            out[i] = _swiglu_oai(gate[i], up[i])
    else:
        for i in prange(gate.shape[0]):
            _glu_one(gate, up, op, table, out, i)


@njit(cache=True, fastmath=FAST, error_model="numpy")
def _glu_serial(gate, up, op, table, out):
    if op == 0:
        for i in range(gate.shape[0]):
            out[i] = _silu(gate[i]) * up[i]
    elif op == 3:
        for i in range(gate.shape[0]):
            out[i] = _swiglu_oai(gate[i], up[i])
    else:
        for i in range(gate.shape[0]):
            _glu_one(gate, up, op, table, out, i)


# a GLU costs an exp (or a table lookup) per element: more than a norm's, so the workers take over sooner; measured
# with 16 threads, a Llama-8B token's 14336-wide SwiGLU took 620 us on one thread
GLU_SERIAL_MAX_ELEMS = 4096


@njit(cache=True)
def glu_rows(gate, up, op, table, out):
    """gate, up, out f32 (n,): out = act(gate) * up, op as _glu_one. One token of a small model's FFN on the calling
    thread (waking the workers costs more than the work), larger ones in parallel: the one place that choice is
    made, for the GLUs here and for compiled callers (kernels_cpu.fused_layer) alike."""
    if gate.shape[0] <= GLU_SERIAL_MAX_ELEMS:
        _glu_serial(gate, up, op, table, out)
    else:
        _glu_par(gate, up, op, table, out)


@njit(cache=True, fastmath=True, parallel=True)
def _softmax_rows(x, out):
    # x (n_rows, n) f32 -> out, each row exp(x - max) / sum (sum in float64, as ggml)
    n_rows, n = x.shape
    for r in prange(n_rows):
        m = x[r, 0]
        for j in range(1, n):
            m = max(m, x[r, j])
        s = 0.0
        for j in range(n):
            e = np.exp(x[r, j] - m)
            out[r, j] = e
            s += e
        inv = np.float32(1.0 / s)
        for j in range(n):
            out[r, j] *= inv


def _flat(x: np.ndarray, name: str) -> np.ndarray:
    if x.dtype != np.float32:
        raise ValueError(f"{name}: expected float32, found {x.dtype}")
    return np.ascontiguousarray(x).reshape(-1)


def _out_like(x: np.ndarray, out: np.ndarray | None, name: str) -> np.ndarray:
    if out is None:
        return np.empty(x.shape, dtype=np.float32)
    if out.shape != x.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"{name}: out must be C-contiguous float32 {x.shape}, found {out.dtype} {out.shape}")
    return out


def _apply(x: np.ndarray, op: int, cap: float, out: np.ndarray | None, name: str) -> np.ndarray:
    out = _out_like(x, out, name)
    _unary(_flat(x, name), op, np.float32(cap), GELU_F16_TABLE, out.reshape(-1))
    return out


def silu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x / (1 + exp(-x)), f32, any shape."""
    return _apply(x, 0, 1.0, out, "silu")


def gelu(x: np.ndarray, out: np.ndarray | None = None, f16_table: bool = False) -> np.ndarray:
    """0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))), f32, any shape (ggml_gelu)."""
    return _apply(x, 2 if f16_table else 1, 1.0, out, "gelu")


def softcap(x: np.ndarray, cap: float, out: np.ndarray | None = None) -> np.ndarray:
    """cap * tanh(x / cap), f32, any shape (gemma's logit soft-capping)."""
    if not cap > 0:
        raise ValueError(f"softcap: cap must be > 0, found {cap}")
    return _apply(x, 3, cap, out, "softcap")


def _glu_apply(gate: np.ndarray, up: np.ndarray, op: int, out: np.ndarray | None, name: str) -> np.ndarray:
    if gate.shape != up.shape:
        raise ValueError(f"{name}: gate and up must have one shape, found {gate.shape} and {up.shape}")
    out = _out_like(gate, out, name)
    glu_rows(_flat(gate, name), _flat(up, name), op, GELU_F16_TABLE, out.reshape(-1))
    return out


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up, f32 (n_tok, n_ff) or any shape."""
    return _glu_apply(gate, up, 0, out, "swiglu")


def geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None, f16_table: bool = False) -> np.ndarray:
    """gelu(gate) * up, f32 (n_tok, n_ff) or any shape."""
    return _glu_apply(gate, up, 2 if f16_table else 1, out, "geglu")


def swiglu_oai(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """gpt-oss's clamped SwiGLU, ggml_compute_forward_swiglu_oai_f32 (alpha 1.702, limit 7.0): x = min(gate, limit),
    y = clamp(up, -limit, limit), x / (1 + exp(-alpha x)) * (y + 1); f32, any shape. The compiled GLU (op 3) that
    the fused MoE experts use too, so that the op-by-op and fused paths agree bit for bit."""
    return _glu_apply(gate, up, 3, out, "swiglu_oai")


def softmax(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the last axis: x (..., n) f32 -> f32, same shape."""
    if x.dtype != np.float32 or x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"softmax: expected float32 (..., n>0), found {x.dtype} {x.shape}")
    out = _out_like(x, out, "softmax")
    n = x.shape[-1]
    _softmax_rows(np.ascontiguousarray(x).reshape(-1, n), out.reshape(-1, n))
    return out

