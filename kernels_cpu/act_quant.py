"""Activation conversion to a weight type's vec_dot_type, as ggml does before a matrix product.

Q8_0, Q8_1 and Q8_K follow ggml's reference `quantize_row_q8_0_ref` / `quantize_row_q8_1_ref` /
`quantize_row_q8_K_ref` bit for bit, but are stored as separate arrays (structure of arrays) rather than packed
blocks, so kernels index them directly:
  block_q8_0: d (fp16), qs[32] int8
        -> qs int8 (n_tok, n_in), d float32 (n_tok, n_in/32) holding the fp16 value
  block_q8_1: d (fp16), s (fp16), qs[32] int8: qs and d as Q8_0's; s = d * sum(qs) with the unrounded d, then
        rounded to fp16 (the min term of Q4_1/Q5_1 dots multiplies it)
        -> qs, d as Q8_0's, s float32 (n_tok, n_in/32) holding the fp16 value
  block_q8_K: d (f32), qs[256] int8, bsums[16] int16
        -> qs int8 (n_tok, n_in), d float32 (n_tok, n_in/256), bsums int16 (n_tok, n_in/16)
These functions are compiled without fastmath: they must round exactly like C (the vector rounding in
`simd.quantize32` is llvm.round / llvm.roundeven: roundf and nearest_int, exactly).
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from kernels_cpu.simd import LL_I8X32, host_features, ir_call, ir_intp, ir_ptr, ir_splat, is_bytes_array, is_f32_array

LL_F32 = ir.FloatType()
LL_F32X32 = ir.VectorType(LL_F32, 32)

QK8_0 = 32
QK_K = 256


# -- vector intrinsics (exact: no fast-math flags on these operations) -----------------------------------------
def _load32f(context, builder, ty, a, off_ty, off):
    return builder.load(ir_ptr(context, builder, ty, a, ir_intp(context, builder, off_ty, off), LL_F32X32), align=4)


def _reduce32(name):
    @intrinsic
    def reduce32(typingctx, a, off):
        if not (is_f32_array(a) and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            v = _load32f(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            if name == "absmax":
                v, name_ = ir_call(builder, "llvm.fabs.v32f32", LL_F32X32, [v]), "fmax"
            else:
                name_ = name
            return ir_call(builder, f"llvm.vector.reduce.{name_}.v32f32", LL_F32, [v])
        return types.float32(a, off), codegen
    return reduce32


absmax32 = _reduce32("absmax")
absmax32.__doc__ = "max |a[off:off+32]| of a float32 array (finite values)."
max32 = _reduce32("fmax")
max32.__doc__ = "max a[off:off+32] of a float32 array (finite values)."
min32 = _reduce32("fmin")
min32.__doc__ = "min a[off:off+32] of a float32 array (finite values)."


@intrinsic
def quantize32(typingctx, a, off, scale, q, qoff, ties_even):
    """q[qoff:qoff+32] = int8(round(a[off:off+32] * scale)) with one float32 multiply per value; rounding
    halfway cases away from zero (C roundf, ggml's Q8_0) or, with ties_even, to even and capped at 127
    (ggml's nearest_int, Q8_K). ties_even must be a compile-time constant."""
    if not (is_f32_array(a) and is_bytes_array(q) and isinstance(scale, types.Float)
            and isinstance(ties_even, (types.BooleanLiteral, types.Boolean))):
        return None
    if not isinstance(ties_even, types.BooleanLiteral):
        return None
    even = ties_even.literal_value

    def codegen(context, builder, sig, args):
        v = _load32f(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        sc = context.cast(builder, args[2], sig.args[2], types.float32)
        v = builder.fmul(v, ir_splat(builder, LL_F32X32, sc))
        v = ir_call(builder, "llvm.roundeven.v32f32" if even else "llvm.round.v32f32", LL_F32X32, [v])
        if even:
            cap = ir_splat(builder, LL_F32X32, ir.Constant(LL_F32, 127.0))
            v = ir_call(builder, "llvm.minnum.v32f32", LL_F32X32, [v, cap])
        iv = builder.fptosi(v, LL_I8X32)
        p = ir_ptr(context, builder, sig.args[3], args[3], ir_intp(context, builder, sig.args[4], args[4]), LL_I8X32)
        builder.store(iv, p, align=1)
        return context.get_dummy_value()
    return types.none(a, off, scale, q, qoff, ties_even), codegen


@intrinsic
def round_f16(typingctx, v):
    """The float32 v rounded to the nearest fp16 (ties to even), as float32; inf past 65504 (vcvtps2ph)."""
    if not isinstance(v, types.Float):
        return None

    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.fpext(builder.fptrunc(x, ir.HalfType()), LL_F32)
    return types.float32(v), codegen


def f16c_available():
    """Whether Numba's target has F16C (round_f16 needs it: without it LLVM would call a runtime helper)."""
    return "f16c" in host_features()


HAS_F16C = f16c_available()  # fp16 rounding in one instruction (a Numba-frozen constant)


@njit(cache=True)
def f32_to_f16_value(v):
    """Round a float32 v >= 0 to the nearest fp16 (ties to even, like GGML_FP32_TO_FP16); float32 result."""
    if v == 0.0:
        return np.float32(0.0)
    _, e = math.frexp(v)  # v = m * 2**e, 0.5 <= m < 1
    q = max(e - 11, -24)  # fp16 keeps 11 significant bits; its smallest step is 2**-24
    r = np.rint(math.ldexp(np.float64(v), -q))
    out = math.ldexp(r, q)
    if out > 65504.0:
        return np.float32(np.inf)
    return np.float32(out)


# Serial: even 512 x 2048 activations take well under a millisecond, and a parallel region costs its
# start-up on every decode step and a few seconds of first compile.
@njit(inline="always")
def _fp16(v):
    """v rounded to the nearest fp16 (ties to even), as float32: one instruction with F16C."""
    if HAS_F16C:
        return round_f16(v)
    return f32_to_f16_value(v) if v >= 0 else -f32_to_f16_value(-v)


@njit(inline="always")
def _q8_block(xf, qf, d, t, b, base):
    # quantize_row_q8_0_ref's block: d = amax/127, qs = roundf(x * (1/d)); d stored as fp16. Returns d unrounded.
    db = absmax32(xf, base) / np.float32(127.0)
    idb = np.float32(1.0) / db if db != 0.0 else np.float32(0.0)
    d[t, b] = _fp16(db)
    quantize32(xf, base, idb, qf, base, False)
    return db


@njit(inline="always")
def quantize_q8_0_token(xf, qf, d, t, n_in):
    for b in range(n_in // QK8_0):
        _q8_block(xf, qf, d, t, b, t * n_in + b * QK8_0)


@njit(inline="always")
def quantize_q8_1_token(xf, qf, d, s, t, n_in):
    # quantize_row_q8_1_ref: qs and d as Q8_0's; s = fp16(sum(qs) * d), d before its fp16 rounding.
    for b in range(n_in // QK8_0):
        base = t * n_in + b * QK8_0
        db = _q8_block(xf, qf, d, t, b, base)
        total = 0
        for j in range(base, base + QK8_0):
            total += np.int32(qf[j])
        s[t, b] = _fp16(np.float32(total) * db)


@njit(cache=True)
def quantize_q8_1_rows(x, qs, d, s):
    """Fill qs int8 (n_tok, n_in), d and s float32 (n_tok, n_in // 32) from C-contiguous x float32 (n_tok, n_in)."""
    n_tok, n_in = x.shape
    for t in range(n_tok):
        quantize_q8_1_token(x.reshape(x.size), qs.reshape(qs.size), d, s, t, n_in)


def quantize_q8_1(x):
    """x float32 (n_tok, n_in), n_in % 32 == 0 -> (qs int8 (n_tok, n_in), d, s float32 (n_tok, n_in // 32))."""
    n_tok, n_in = x.shape
    qs = np.empty((n_tok, n_in), dtype=np.int8)
    d = np.empty((n_tok, n_in // QK8_0), dtype=np.float32)
    s = np.empty((n_tok, n_in // QK8_0), dtype=np.float32)
    quantize_q8_1_rows(np.ascontiguousarray(x), qs, d, s)
    return qs, d, s


@njit(cache=True)
def quantize_q8_0_rows(x, qs, d):
    """Fill qs int8 (n_tok, n_in), d float32 (n_tok, n_in // 32) from C-contiguous x float32 (n_tok, n_in)."""
    n_tok, n_in = x.shape
    for t in range(n_tok):
        quantize_q8_0_token(x.reshape(x.size), qs.reshape(qs.size), d, t, n_in)


def quantize_q8_0(x):
    """x float32 (n_tok, n_in), n_in % 32 == 0 -> (qs int8 (n_tok, n_in), d float32 (n_tok, n_in // 32))."""
    n_tok, n_in = x.shape
    qs = np.empty((n_tok, n_in), dtype=np.int8)
    d = np.empty((n_tok, n_in // QK8_0), dtype=np.float32)
    quantize_q8_0_rows(np.ascontiguousarray(x), qs, d)
    return qs, d


@njit(inline="always")
def quantize_q8_k_token(xf, qf, d, bsums, t, n_in):
    # quantize_row_q8_K_ref: the element of largest magnitude (first one on ties) maps to -127 exactly.
    for b in range(n_in // QK_K):
        base = t * n_in + b * QK_K
        amax = np.float32(0.0)
        hi = np.float32(-np.inf)
        for j in range(0, QK_K, 32):
            amax = max(amax, absmax32(xf, base + j))
            hi = max(hi, max32(xf, base + j))
        if amax == 0.0:
            d[t, b] = np.float32(0.0)
            qf[base:base + QK_K] = 0
            bsums[t, b * 16:(b + 1) * 16] = 0
            continue
        vmax = amax
        if hi != amax:
            vmax = -amax
        else:  # +amax is present; -amax too? then the first of the two wins
            lo = np.float32(np.inf)
            for j in range(0, QK_K, 32):
                lo = min(lo, min32(xf, base + j))
            if lo == -amax:
                for j in range(QK_K):
                    if abs(xf[base + j]) == amax:
                        vmax = xf[base + j]
                        break
        iscale = np.float32(-127.0) / vmax
        for j in range(0, QK_K, 32):
            quantize32(xf, base + j, iscale, qf, base + j, True)
        for g in range(QK_K // 16):
            s = 0
            for j in range(16):
                s += qf[base + g * 16 + j]
            bsums[t, b * 16 + g] = s
        d[t, b] = np.float32(1.0) / iscale


@njit(cache=True)
def quantize_q8_k_rows(x, qs, d, bsums):
    """Fill qs int8 (n_tok, n_in), d float32 (n_tok, n_in // 256), bsums int16 (n_tok, n_in // 16) from
    C-contiguous x float32 (n_tok, n_in)."""
    n_tok, n_in = x.shape
    for t in range(n_tok):
        quantize_q8_k_token(x.reshape(x.size), qs.reshape(qs.size), d, bsums, t, n_in)


def quantize_q8_k(x):
    """x float32 (n_tok, n_in), n_in % 256 == 0 ->
    (qs int8 (n_tok, n_in), d float32 (n_tok, n_in // 256), bsums int16 (n_tok, n_in // 16))."""
    n_tok, n_in = x.shape
    qs = np.empty((n_tok, n_in), dtype=np.int8)
    d = np.empty((n_tok, n_in // QK_K), dtype=np.float32)
    bsums = np.empty((n_tok, n_in // 16), dtype=np.int16)
    quantize_q8_k_rows(np.ascontiguousarray(x), qs, d, bsums)
    return qs, d, bsums


@njit(cache=True)
def dequantize_q8_0(qs, d):
    """The float32 values (n_tok, n_in) of Q8_0 activations: qs * d per 32-block (exact in float32)."""
    n_tok, n_in = qs.shape
    out = np.empty((n_tok, n_in), dtype=np.float32)
    for t in range(n_tok):
        for b in range(n_in // QK8_0):
            db = d[t, b]
            for j in range(b * QK8_0, (b + 1) * QK8_0):
                out[t, j] = np.float32(qs[t, j]) * db
    return out


def round_to_f16(x):
    """float32 array -> float32 array of the nearest fp16 values (GGML_FP32_TO_FP16, ties to even)."""
    return x.astype(np.float16).astype(np.float32)


def round_to_bf16(x):
    """float32 array -> float32 array of the nearest bf16 values, as ggml_compute_fp32_to_bf16 rounds
    (ties to even on the bit pattern; NaN stays a quiet NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (u | np.uint32(0x00400000)) & np.uint32(0xFFFF0000)
    return np.where(nan, quiet, rounded).view(np.float32)
