"""Vector intrinsics of the 8-row interleaved layouts (kernels_cpu.q4_k_x8, kernels_cpu.legacy_x8): a 32-byte
register holds 8 code bytes of each of 4 rows, so one activation broadcast and one scale load serve 4 rows, and
16-bit accumulators per row sum a sub-block before its scale is applied.

Generic LLVM vector IR (shuffles, extends, adds); LLVM picks the x86 forms (vpbroadcastq, vpmovzxbw, vpshufb,
vhaddps) for the host.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels_cpu.simd import (FORCE_GENERIC, F32x8, I8x32, I16x16, I32x8, _F32x8, _I8, _I16, _I32, _I64, _V8x32,
                              _V16x16, _V32x8, _features, host_features, ir_call, ir_const_vec, ir_intp, ir_ptr,
                              ir_shuffle, ir_splat, is_bytes_array)


@intrinsic
def bcast_i8x8(typingctx, a, off):
    """The 8 bytes a[off:off + 8] repeated 4 times (one token's 8 activations against 4 rows' 8 codes)."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _I64)
        v = ir_splat(builder, ir.VectorType(_I64, 4), builder.load(p, align=1))
        return builder.bitcast(v, _V8x32)
    return I8x32(a, off), codegen


@intrinsic
def gather_i8x8x4(typingctx, a, off, stride):
    """The 4 runs of 8 bytes at a[off + k * stride:...+ 8], k = 0..3, as one 32-byte vector (one row's codes
    of 32 weights, out of 4 interleaved chunks)."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer) and isinstance(stride, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        off = ir_intp(context, builder, sig.args[1], args[1])
        stride = ir_intp(context, builder, sig.args[2], args[2])
        v = ir.Constant(ir.VectorType(_I64, 4), ir.Undefined)
        for k in range(4):
            o = builder.add(off, builder.mul(stride, ir.Constant(off.type, k)))
            x = builder.load(ir_ptr(context, builder, sig.args[0], args[0], o, _I64), align=1)
            v = builder.insert_element(v, x, ir.Constant(_I32, k))
        return builder.bitcast(v, _V8x32)
    return I8x32(a, off, stride), codegen


def _scales4(signed):
    @intrinsic
    def scales4(typingctx, a, off):
        if not (is_bytes_array(a) and isinstance(off, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            v4 = ir.VectorType(_I8, 4)
            p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), v4)
            b = builder.load(p, align=1)
            b16 = ir_shuffle(builder, b, b, [r // 4 for r in range(16)])
            return builder.sext(b16, _V16x16) if signed else builder.zext(b16, _V16x16)
        return I16x16(a, off), codegen
    return scales4


# The 4 bytes a[off:off + 4] as int16 lanes, each 4 times: lanes 4r..4r + 3 = byte r, the scale of row r against
# the 4 lanes maddubs leaves per row of an interleaved register; unsigned (Q4_K's) or signed (IQ4_XS's ls - 32).
scales4_u8 = _scales4(False)
scales4_i8 = _scales4(True)


@intrinsic
def load_u8x16(typingctx, a, off):
    """The 16 unsigned bytes a[off:off + 16] as int16 lanes."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), v16)
        return builder.zext(builder.load(p, align=1), _V16x16)
    return I16x16(a, off), codegen


@intrinsic
def bsum_pair(typingctx, bsums, off):
    """From the 4 int16 sums of 16 activations bsums[off:off + 4]: lanes 2k = bsums[off] + bsums[off + 1] and
    2k + 1 = bsums[off + 2] + bsums[off + 3], k = 0..7 (the sums of two 32-value sub-blocks, for vpmaddwd with
    8 rows' pairs of mins; exact: |sum| <= 32 * 127)."""
    if not (isinstance(bsums, types.Array) and bsums.dtype == types.int16 and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v4 = ir.VectorType(_I16, 4)
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), v4)
        b = builder.load(p, align=2)
        s = builder.add(ir_shuffle(builder, b, b, [0, 2]), ir_shuffle(builder, b, b, [1, 3]))  # <2 x i16>
        v = ir_splat(builder, _V32x8, builder.bitcast(s, _I32))
        return builder.bitcast(v, _V16x16)
    return I16x16(bsums, off), codegen


@intrinsic
def load_e8m0_half_x8(typingctx, a, off):
    """The 8 E8M0 bytes a[off:off + 8] as float32 lanes of ggml_e8m0_to_fp32_half (2**(e - 128), exact: e < 2 the
    subnormals 0x00200000 << e, else the bits (e - 1) << 23): 8 MXFP4 rows' block scales."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_I8, 8)
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), v8)
        e = builder.zext(builder.load(p, align=1), _V32x8)

        def c(v):
            return ir_const_vec(_V32x8, [v] * 8)
        normal = builder.shl(builder.sub(e, c(1)), c(23))
        sub = builder.shl(c(0x00200000), builder.and_(e, c(1)))  # e & 1 == e where taken
        bits = builder.select(builder.icmp_unsigned("<", e, c(2)), sub, normal)
        return builder.bitcast(bits, _F32x8)
    return F32x8(a, off), codegen


@intrinsic
def load_nib8x2(typingctx, a, off, stride):
    """The 8 bytes at a[off:] and the 8 at a[off + stride:] as 32 nibbles: lanes 0-15 their low nibbles, 16-31 their
    high ones (load_nib16's order: one row's block_mxfp4 codes out of 2 interleaved runs)."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer) and isinstance(stride, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        off = ir_intp(context, builder, sig.args[1], args[1])
        second = builder.add(off, ir_intp(context, builder, sig.args[2], args[2]))
        v = ir.Constant(ir.VectorType(_I64, 2), ir.Undefined)
        for k, o in enumerate((off, second)):
            x = builder.load(ir_ptr(context, builder, sig.args[0], args[0], o, _I64), align=1)
            v = builder.insert_element(v, x, ir.Constant(_I32, k))
        v16 = ir.VectorType(_I8, 16)
        v = builder.bitcast(v, v16)
        lo = builder.and_(v, ir_const_vec(v16, [15] * 16))
        hi = builder.lshr(v, ir_const_vec(v16, [4] * 16))
        return ir_shuffle(builder, lo, hi, range(32))
    return I8x32(a, off, stride), codegen


@intrinsic
def scale_f32(typingctx, v, s):
    """v * s for a scalar s."""
    if not (v == F32x8 and isinstance(s, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        s = context.cast(builder, args[1], sig.args[1], types.float32)
        return builder.fmul(args[0], ir_splat(builder, _F32x8, s))
    return F32x8(v, s), codegen


def _dup_pairs(first):
    """Lanes 2r, 2r + 1 = lane first + r of v (r = 0..3): per-row float factors against 2 lanes per row."""
    @intrinsic
    def dup(typingctx, v):
        if v != F32x8:
            return None

        def codegen(context, builder, sig, args):
            return ir_shuffle(builder, args[0], args[0], [first + r // 2 for r in range(8)])
        return F32x8(v), codegen
    return dup


dup_lo_f32 = _dup_pairs(0)  # rows 0-3 of 8 per-row values
dup_hi_f32 = _dup_pairs(4)  # rows 4-7


@intrinsic
def pairsum_sub_f32(typingctx, lo, hi, m):
    """[lo0 + lo1, lo2 + lo3, lo4 + lo5, lo6 + lo7, hi0 + hi1, ..., hi6 + hi7] - m: 8 rows' sums of their two
    lanes, minus their min terms."""
    if not (lo == F32x8 and hi == F32x8 and m == F32x8):
        return None

    def codegen(context, builder, sig, args):
        lo, hi, m = args
        even = ir_shuffle(builder, lo, hi, [0, 2, 4, 6, 8, 10, 12, 14])
        odd = ir_shuffle(builder, lo, hi, [1, 3, 5, 7, 9, 11, 13, 15])
        return builder.fsub(builder.fadd(even, odd), m)
    return F32x8(lo, hi, m), codegen



# -- VNNI (vpdpbusd): 4 unsigned x signed byte products summed into an int32 lane, exactly ------------------------
def vnni_in(features) -> bool:
    """Whether target features (a set of names) give vpdpbusd on 256-bit registers: AVX-VNNI, or AVX-512 VNNI+VL."""
    return "avxvnni" in features or {"avx512vnni", "avx512vl"} <= features


def _vnni(context) -> bool:
    return vnni_in(_features(context)) and not FORCE_GENERIC[0]


def host_vnni() -> bool:
    """has_vnni()'s answer for this process's target (the host, or what NUMBA_CPU_NAME/NUMBA_CPU_FEATURES make it),
    in plain Python for dispatch code; FORCE_GENERIC, a switch of tests for the kernels they compile, is not asked."""
    return vnni_in(host_features())


@intrinsic
def has_vnni(typingctx):
    """Whether the target has vpdpbusd on 256-bit registers (AVX-VNNI, or AVX-512 VNNI with VL): a compile-time
    constant, so a branch on it leaves one path in the machine code."""
    def codegen(context, builder, sig, args):
        return ir.Constant(ir.IntType(1), int(_vnni(context)))
    return types.boolean(), codegen


@intrinsic
def dpbusd(typingctx, acc, u, s):
    """acc + int32 lanes k = sum_{j<4} u[4k + j] * s[4k + j] (u unsigned, s signed bytes; exact, no saturation).
    vpdpbusd where has_vnni(); elsewhere the same sums through wider integers (correct, slow: callers branch)."""
    if not (acc == I32x8 and u == I8x32 and s == I8x32):
        return None

    def codegen(context, builder, sig, args):
        acc, u, s = args
        if _vnni(context):
            return ir_call(builder, "llvm.x86.avx512.vpdpbusd.256", _V32x8,
                           [acc, builder.bitcast(u, _V32x8), builder.bitcast(s, _V32x8)])
        w32 = ir.VectorType(_I32, 32)
        p = builder.mul(builder.zext(u, w32), builder.sext(s, w32))
        for j in range(4):
            acc = builder.add(acc, ir_shuffle(builder, p, p, range(j, 32, 4)))
        return acc
    return I32x8(acc, u, s), codegen


@intrinsic
def scales4x2_i8(typingctx, a, off):
    """The 4 signed bytes a[off:off + 4] as int32 lanes, each twice: lanes 2r, 2r + 1 = byte r, the scale of row r
    against the 2 int32 lanes dpbusd leaves per row of an interleaved register."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v4 = ir.VectorType(_I8, 4)
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), v4)
        b = builder.load(p, align=1)
        return builder.sext(ir_shuffle(builder, b, b, [r // 2 for r in range(8)]), _V32x8)
    return I32x8(a, off), codegen


@intrinsic
def mul_i32(typingctx, a, b):
    """a * b, int32 lanes (vpmulld; callers keep it exact)."""
    if not (a == I32x8 and b == I32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.mul(args[0], args[1])
    return I32x8(a, b), codegen


@intrinsic
def sub_i32(typingctx, a, b):
    """a - b, int32 lanes."""
    if not (a == I32x8 and b == I32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.sub(args[0], args[1])
    return I32x8(a, b), codegen



# -- Q8_0_X8 (kernels_cpu.q8_0_x8): 8 rows x 4 bytes a register, one int32 lane a row ------------------------------
@intrinsic
def bcast_i8x4(typingctx, a, off):
    """The 4 bytes a[off:off + 4] repeated 8 times (one token's 4 activations against 8 rows' 4 codes; with
    AVX-512 VL the load folds into vpdpbusd as a {1to8} broadcast)."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _I32)
        return builder.bitcast(ir_splat(builder, _V32x8, builder.load(p, align=1)), _V8x32)
    return I8x32(a, off), codegen


@intrinsic
def splat_i32(typingctx, s):
    """All 8 int32 lanes = s (truncated to int32)."""
    if not isinstance(s, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), _I32)
        return ir_splat(builder, _V32x8, x)
    return I32x8(s), codegen


@intrinsic
def gather_i8x4x8(typingctx, a, off, stride):
    """The 8 runs of 4 bytes at a[off + k * stride:...+ 4], k = 0..7, as one 32-byte vector (one row's 32 codes out
    of 8 interleaved chunks)."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer) and isinstance(stride, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        off = ir_intp(context, builder, sig.args[1], args[1])
        stride = ir_intp(context, builder, sig.args[2], args[2])
        v = ir.Constant(_V32x8, ir.Undefined)
        for k in range(8):
            o = builder.add(off, builder.mul(stride, ir.Constant(off.type, k)))
            x = builder.load(ir_ptr(context, builder, sig.args[0], args[0], o, _I32), align=1)
            v = builder.insert_element(v, x, ir.Constant(_I32, k))
        return builder.bitcast(v, _V8x32)
    return I8x32(a, off, stride), codegen
