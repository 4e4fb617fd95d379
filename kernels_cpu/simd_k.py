"""Vector intrinsics for the K-quant super-blocks (vec_dot_k): scales kept in a vector register and broadcast
per sub-block by a byte shuffle, as ggml's AVX2 kernels do, instead of extracting, shifting and broadcasting each
scale as a scalar; and Q6_K's 32 * x term, to dot unsigned 6-bit codes.

`shuffle_scales(v, table, row)` is vpshufb on AVX2 (generic IR elsewhere); the tables say which int16 lane each
output lane takes (within its 128-bit half, as vpshufb).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kernels_cpu.simd import I8x32, I16x16, I32x8, has_avx2, ir_call, ir_const_vec, ir_ptr, ir_shuffle
from kernels_cpu.simd_int import _maddubs

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V8x32 = ir.VectorType(_I8, 32)
_V16x8 = ir.VectorType(_I16, 8)
_V16x16 = ir.VectorType(_I16, 16)


def _lane_table(pairs: list[tuple[int, int]]) -> np.ndarray:
    """Rows of vpshufb masks: row r makes int16 lanes 0-7 = lane pairs[r][0] and lanes 8-15 = lane pairs[r][1]
    of a vector whose two 128-bit halves hold the same 8 int16 values."""
    t = np.empty((len(pairs), 32), np.int8)
    for r, (a, b) in enumerate(pairs):
        t[r, :16] = [2 * a, 2 * a + 1] * 8
        t[r, 16:] = [2 * b, 2 * b + 1] * 8
    return t


# Q4_K/Q5_K: the 32-value sub-block m (0..7) takes scale m in every lane
K4_SCALE_SHUF = _lane_table([(m, m) for m in range(8)])
# Q6_K: of the 8 scales of a 128-value half, the 32 values of group k take scale 2k (first 16) and 2k + 1 (last 16)
K6_SCALE_SHUF = _lane_table([(2 * k, 2 * k + 1) for k in range(4)])


def _bytes_and_offset(a, off) -> bool:
    """Whether an intrinsic's (a, off) are a byte array and an integer offset into it."""
    return isinstance(a, types.Array) and a.dtype in (types.uint8, types.int8) and isinstance(off, types.Integer)


def _load_bytes(context, builder, sig, args, n: int):
    """The <n x i8> at a[off] of an intrinsic's arguments (a, off), unaligned."""
    off64 = context.cast(builder, args[1], sig.args[1], types.intp)
    return builder.load(ir_ptr(context, builder, sig.args[0], args[0], off64, ir.VectorType(_I8, n)), align=1)


def _dup8(builder, v8):
    """<8 x i16> -> <16 x i16> with both 128-bit halves = v8."""
    return ir_shuffle(builder, v8, v8, list(range(8)) * 2)


@intrinsic
def scales_from_u64(typingctx, v):
    """The 8 bytes of v (little-endian, unsigned) as int16 lanes 0-7, repeated in lanes 8-15."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.uint64)
        bytes8 = builder.bitcast(x, ir.VectorType(_I8, 8))
        return _dup8(builder, builder.zext(bytes8, _V16x8))
    return I16x16(v), codegen


@intrinsic
def scales_i8x8(typingctx, a, off):
    """The 8 signed bytes a[off:off + 8] as int16 lanes 0-7, repeated in lanes 8-15."""
    if not _bytes_and_offset(a, off):
        return None

    def codegen(context, builder, sig, args):
        return _dup8(builder, builder.sext(_load_bytes(context, builder, sig, args, 8), _V16x8))
    return I16x16(a, off), codegen


@intrinsic
def shuffle_scales(typingctx, v, table, row):
    """vpshufb of v's bytes by the mask table[row] (an int8 (n, 32) table of this module)."""
    if not (v == I16x16 and isinstance(table, types.Array) and table.dtype == types.int8
            and isinstance(row, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        off = builder.mul(context.cast(builder, args[2], sig.args[2], types.intp), ir.Constant(_I64, 32))
        mask = builder.load(ir_ptr(context, builder, sig.args[1], args[1], off, _V8x32), align=1)
        src = builder.bitcast(args[0], _V8x32)
        if has_avx2(context):
            out = ir_call(builder, "llvm.x86.avx2.pshuf.b", _V8x32, [src, mask])
        else:  # vpshufb's rule: byte j of a half takes byte (mask & 15) of the same half (masks here are >= 0)
            out = ir.Constant(_V8x32, None)
            for j in range(32):
                idx = builder.and_(builder.extract_element(mask, ir.Constant(_I32, j)), ir.Constant(_I8, 15))
                src_j = builder.add(builder.zext(idx, _I32), ir.Constant(_I32, 16 * (j // 16)))
                out = builder.insert_element(out, builder.extract_element(src, src_j), ir.Constant(_I32, j))
        return builder.bitcast(out, _V16x16)
    return I16x16(v, table, row), codegen


@intrinsic
def maddubs_32(typingctx, x):
    """maddubs(32, x): int16 lane k = 32 (x[2k] + x[2k+1]), what `maddubs(q, x) - maddubs_32(x)` subtracts to
    dot x with q - 32 for unsigned 6-bit q (Q6_K), exactly: |sums| <= 2 * 63 * 127 < 2**15."""
    if x != I8x32:
        return None

    def codegen(context, builder, sig, args):
        return _maddubs(context, builder, ir_const_vec(_V8x32, [32] * 32), args[0])
    return I16x16(x), codegen


@intrinsic
def sub_i16(typingctx, a, b):
    """a - b, int16 lanes (wrapping; callers keep it exact)."""
    if not (a == I16x16 and b == I16x16):
        return None

    def codegen(context, builder, sig, args):
        return builder.sub(args[0], args[1])
    return I16x16(a, b), codegen


@intrinsic
def mins_pairs_from_u64(typingctx, v):
    """The 8 bytes of v (little-endian, unsigned) as int16 lanes, each twice: lanes 2g and 2g + 1 = byte g, to
    multiply-add (vpmaddwd) with the 16 sums of 16 activations of a Q8_K block: lane g of the result is then
    min_g * (the sum of sub-block g's 32 activations), exactly (6-bit mins, |sums| <= 2 * 16 * 127)."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        x = context.cast(builder, args[0], sig.args[0], types.uint64)
        bytes8 = builder.bitcast(x, ir.VectorType(_I8, 8))
        pairs = ir_shuffle(builder, bytes8, bytes8, [g // 2 for g in range(16)])
        return builder.zext(pairs, _V16x16)
    return I16x16(v), codegen


@intrinsic
def scale_pair_i32(typingctx, a, off):
    """The 2 signed bytes a[off], a[off + 1] as int32 lanes 0-3 and 4-7: Q6_K's two 16-element scales of a group of
    32 codes against the int32 lanes vpdpbusd leaves (lane j: codes 4j..4j+3)."""
    if not _bytes_and_offset(a, off):
        return None

    def codegen(context, builder, sig, args):
        b = _load_bytes(context, builder, sig, args, 2)
        return builder.sext(ir_shuffle(builder, b, b, [0, 0, 0, 0, 1, 1, 1, 1]), ir.VectorType(_I32, 8))
    return I32x8(a, off), codegen
