"""Vector intrinsics of the codebook (IQ) types: 32 weights' grid entries gathered from a byte table into one I8x32,
sign bits spread to +-1 lanes, and lanewise byte addition (kernels_cpu.vec_dot_iq).

Generic LLVM vector IR (loads, inserts, shuffles, selects); LLVM picks the x86 forms for the host.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels_cpu.simd import I8x32, _I8, _I32, _V8x32, ir_const_vec, ir_ptr, ir_shuffle, is_bytes_array


def _gather(context, builder, sig, args, width):
    """Entries idx_k (args[1:]) of `width` bytes of the byte table args[0], as lanes of one 32-byte vector."""
    elt = ir.IntType(8 * width)
    n = 32 // width
    v = ir.Constant(ir.VectorType(elt, n), ir.Undefined)
    for k in range(n):
        idx = context.cast(builder, args[1 + k], sig.args[1 + k], types.intp)
        off = builder.mul(idx, ir.Constant(idx.type, width))
        x = builder.load(ir_ptr(context, builder, sig.args[0], args[0], off, elt), align=1)
        v = builder.insert_element(v, x, ir.Constant(_I32, k))
    return builder.bitcast(v, _V8x32)


@intrinsic
def grid8x4(typingctx, table, i0, i1, i2, i3):
    """Bytes 8 i_k .. 8 i_k + 7 of `table` for k = 0..3, in order: four 8-byte grid entries (iq2/iq1 grids)."""
    if not (is_bytes_array(table) and all(isinstance(i, types.Integer) for i in (i0, i1, i2, i3))):
        return None

    def codegen(context, builder, sig, args):
        return _gather(context, builder, sig, args, 8)
    return I8x32(table, i0, i1, i2, i3), codegen


@intrinsic
def grid4x8(typingctx, table, i0, i1, i2, i3, i4, i5, i6, i7):
    """Bytes 4 i_k .. 4 i_k + 3 of `table` for k = 0..7, in order: eight 4-byte grid entries (iq3 grids)."""
    idx = (i0, i1, i2, i3, i4, i5, i6, i7)
    if not (is_bytes_array(table) and all(isinstance(i, types.Integer) for i in idx)):
        return None

    def codegen(context, builder, sig, args):
        return _gather(context, builder, sig, args, 4)
    return I8x32(table, *idx), codegen


@intrinsic
def signs_u32(typingctx, word):
    """Lane j = -1 where bit j of the 32-bit `word` is set, else 1 (for vpsignb, as ggml's sign masks)."""
    if not isinstance(word, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        w = builder.trunc(context.cast(builder, args[0], sig.args[0], types.int64), _I32)
        v4 = builder.bitcast(w, ir.VectorType(_I8, 4))
        rep = ir_shuffle(builder, v4, ir.Constant(ir.VectorType(_I8, 4), ir.Undefined), [j // 8 for j in range(32)])
        bit = builder.and_(rep, ir_const_vec(_V8x32, [1 << (j % 8) for j in range(32)]))
        isset = builder.icmp_unsigned("!=", bit, ir.Constant(_V8x32, None))
        return builder.select(isset, ir_const_vec(_V8x32, [255] * 32), ir_const_vec(_V8x32, [1] * 32))
    return I8x32(word), codegen


@intrinsic
def add_i8(typingctx, a, b):
    """a + b, byte lanes (wrapping; callers keep it exact)."""
    if not (a == I8x32 and b == I8x32):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return I8x32(a, b), codegen
