"""Integer SIMD operations for the Numba kernels: byte arithmetic on I8x32 (masks, shifts, sign tricks, a
16-entry table lookup) and ggml's AVX2 integer dot products (vpmaddubsw, vpmaddwd and their sums), as LLVM
vector IR; vector types, loads, stores and floats are in kernels_cpu.simd.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels_cpu.simd import (I8x32, I16x16, I32x8, _I1, _I8, _I16, _I32, _I64, _V8x32, _V16x16, _V32x8, has_avx2,
                              ir_call, ir_const_vec, ir_intp, ir_ptr, ir_shuffle, ir_splat, is_bytes_array)


# -- byte operations ---------------------------------------------------------------------------------------
def _i8_scalar(context, builder, ty, v):
    return builder.trunc(context.cast(builder, v, ty, types.int64), _I8)


@intrinsic
def and_i8(typingctx, v, c):
    """Lanewise v & c (c a scalar)."""
    if not (v == I8x32 and isinstance(c, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.and_(args[0], ir_splat(builder, _V8x32, _i8_scalar(context, builder, sig.args[1], args[1])))
    return I8x32(v, c), codegen


@intrinsic
def shr_i8(typingctx, v, k):
    """Lanewise logical shift right by k (0 <= k < 8)."""
    if not (v == I8x32 and isinstance(k, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], ir_splat(builder, _V8x32, _i8_scalar(context, builder, sig.args[1], args[1])))
    return I8x32(v, k), codegen


@intrinsic
def shl_i8(typingctx, v, k):
    """Lanewise shift left by k (0 <= k < 8)."""
    if not (v == I8x32 and isinstance(k, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.shl(args[0], ir_splat(builder, _V8x32, _i8_scalar(context, builder, sig.args[1], args[1])))
    return I8x32(v, k), codegen


@intrinsic
def addc_i8(typingctx, v, c):
    """Lanewise v + c (c a scalar), wrapping."""
    if not (v == I8x32 and isinstance(c, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], ir_splat(builder, _V8x32, _i8_scalar(context, builder, sig.args[1], args[1])))
    return I8x32(v, c), codegen


@intrinsic
def or_i8(typingctx, a, b):
    if not (a == I8x32 and b == I8x32):
        return None

    def codegen(context, builder, sig, args):
        return builder.or_(args[0], args[1])
    return I8x32(a, b), codegen


@intrinsic
def abs_i8(typingctx, v):
    """Lanewise |v| as int8 (|-128| is 128 read as unsigned)."""
    if v != I8x32:
        return None

    def codegen(context, builder, sig, args):
        return ir_call(builder, "llvm.abs.v32i8", _V8x32, [args[0], ir.Constant(_I1, 0)])
    return I8x32(v), codegen


@intrinsic
def sign_i8(typingctx, x, w):
    """Lanewise x * sign(w) for int8 lanes (vpsignb): -x where w < 0, 0 where w == 0, x otherwise."""
    if not (x == I8x32 and w == I8x32):
        return None

    def codegen(context, builder, sig, args):
        x, w = args
        if has_avx2(context):
            return ir_call(builder, "llvm.x86.avx2.psign.b", _V8x32, [x, w])
        zero = ir.Constant(_V8x32, None)
        neg = builder.select(builder.icmp_signed("<", w, zero), builder.sub(zero, x), x)
        return builder.select(builder.icmp_signed("==", w, zero), zero, neg)
    return I8x32(x, w), codegen


@intrinsic
def lut16_i8(typingctx, v, table, off):
    """Lanewise table[off + v] for lanes 0 <= v < 16 (a 16-entry byte table in an array; vpshufb on AVX2)."""
    if not (v == I8x32 and is_bytes_array(table) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        p = ir_ptr(context, builder, sig.args[1], args[1], ir_intp(context, builder, sig.args[2], args[2]), v16)
        t = builder.load(p, align=1)
        if has_avx2(context):
            t2 = ir_shuffle(builder, t, t, range(32))
            return ir_call(builder, "llvm.x86.avx2.pshuf.b", _V8x32, [t2, args[0]])
        out = ir.Constant(_V8x32, ir.Undefined)
        for j in range(32):
            idx = builder.extract_element(args[0], ir.Constant(_I32, j))
            idx = builder.and_(idx, ir.Constant(_I8, 15))
            out = builder.insert_element(out, builder.extract_element(t, idx), ir.Constant(_I32, j))
        return out
    return I8x32(v, table, off), codegen


# -- integer dot products ----------------------------------------------------------------------------------
def _maddubs(context, builder, u, s):
    if has_avx2(context):
        return ir_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16x16, [u, s])
    w32 = ir.VectorType(_I16, 32)
    p = builder.mul(builder.zext(u, w32), builder.sext(s, w32))  # exact: |255 * -128| < 2**15
    even = ir_shuffle(builder, p, p, range(0, 32, 2))
    odd = ir_shuffle(builder, p, p, range(1, 32, 2))
    return ir_call(builder, "llvm.sadd.sat.v16i16", _V16x16, [even, odd])


def _madd(context, builder, a, b):
    if has_avx2(context):
        return ir_call(builder, "llvm.x86.avx2.pmadd.wd", _V32x8, [a, b])
    w16 = ir.VectorType(_I32, 16)
    p = builder.mul(builder.sext(a, w16), builder.sext(b, w16))
    return builder.add(ir_shuffle(builder, p, p, range(0, 16, 2)), ir_shuffle(builder, p, p, range(1, 16, 2)))


@intrinsic
def maddubs(typingctx, u, s):
    """vpmaddubsw: lane k = sat16(u[2k] * s[2k] + u[2k+1] * s[2k+1]), u unsigned bytes, s signed bytes.
    Lanes 0-7 come from bytes 0-15, lanes 8-15 from bytes 16-31."""
    if not (u == I8x32 and s == I8x32):
        return None

    def codegen(context, builder, sig, args):
        return _maddubs(context, builder, args[0], args[1])
    return I16x16(u, s), codegen


@intrinsic
def madd(typingctx, a, b):
    """vpmaddwd: int32 lane k = a[2k] * b[2k] + a[2k+1] * b[2k+1] (int16 lanes)."""
    if not (a == I16x16 and b == I16x16):
        return None

    def codegen(context, builder, sig, args):
        return _madd(context, builder, args[0], args[1])
    return I32x8(a, b), codegen


@intrinsic
def dot_u8i8(typingctx, u, s):
    """int32 lanes whose sum is sum_j u[j] * s[j] (u unsigned, s signed bytes), exact when every pair sum
    u[2k] s[2k] + u[2k+1] s[2k+1] fits int16 (true for u <= 128 and |s| <= 127)."""
    if not (u == I8x32 and s == I8x32):
        return None

    def codegen(context, builder, sig, args):
        ones = ir_const_vec(_V16x16, [1] * 16)
        return _madd(context, builder, _maddubs(context, builder, args[0], args[1]), ones)
    return I32x8(u, s), codegen


@intrinsic
def splat_i16(typingctx, s):
    """All 16 lanes = s."""
    if not isinstance(s, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), _I16)
        return ir_splat(builder, _V16x16, x)
    return I16x16(s), codegen


@intrinsic
def splat2_i16(typingctx, a, b):
    """Lanes 0-7 = a, lanes 8-15 = b: per-16-byte scales for `madd(maddubs(...), .)`."""
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        x = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), _I16)
        y = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), _I16)
        return ir_shuffle(builder, ir_splat(builder, _V16x16, x), ir_splat(builder, _V16x16, y), [0] * 8 + [16] * 8)
    return I16x16(a, b), codegen


@intrinsic
def splat_i8(typingctx, c):
    """All 32 byte lanes = c."""
    if not isinstance(c, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return ir_splat(builder, _V8x32, _i8_scalar(context, builder, sig.args[0], args[0]))
    return I8x32(c), codegen


@intrinsic
def add_i16(typingctx, a, b):
    """a + b, int16 lanes (wrapping; callers keep it exact)."""
    if not (a == I16x16 and b == I16x16):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return I16x16(a, b), codegen


@intrinsic
def add_i32(typingctx, a, b):
    if not (a == I32x8 and b == I32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return I32x8(a, b), codegen


@intrinsic
def zero_i32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_V32x8, None)
    return I32x8(), codegen


@intrinsic
def hsum_i32(typingctx, v):
    """The sum of the 8 int32 lanes, as int64."""
    if v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sext(ir_call(builder, "llvm.vector.reduce.add.v8i32", _I32, [args[0]]), _I64)
    return types.int64(v), codegen
