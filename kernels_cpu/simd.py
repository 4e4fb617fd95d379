"""SIMD building blocks for the Numba kernels: 256-bit vector values and the few operations ggml's AVX2 dot
products are made of, emitted as LLVM vector IR through `numba.extending.intrinsic`.

Plain Numba widens small integers and leaves short loops scalar; these intrinsics keep 32 bytes in one vector
register. Every operation has a generic-IR definition (LLVM lowers it for any host); on hosts whose Numba
target has AVX2 a few map to `llvm.x86.avx2.*` directly, with the same results (the generic `maddubs` saturates
exactly like vpmaddubsw). The choice is made when a kernel is compiled, from Numba's target features, and
Numba's cache is keyed by those features.

Vector types (one LLVM vector each): I8x32 <32 x i8>, I16x16 <16 x i16>, I32x8 <8 x i32>, F32x8 <8 x float>.
Here: the types, target features, IR helpers, loads/stores and float operations; the integer operations are in
kernels_cpu.simd_int, the K-quant scale shuffles in kernels_cpu.simd_k.
Two kernels keep their own intrinsics beside them: the GEMM micro-kernel (gemm_f32) and the exact vector
rounding of the activation quantizers (act_quant).
Array arguments are 1-D (or any contiguous) numpy arrays; offsets count elements of the array's dtype and
are not bounds-checked.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

_I1, _I8, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_V8x32, _V16x16 = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
_V32x8, _F32x8 = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
LL_I8X32, LL_F32X8 = _V8x32, _F32x8  # for the intrinsics of other modules (gemm_f32, act_quant)


class _Vec(types.Type):
    """A 256-bit SIMD value held in registers (never stored in arrays: use the load/store intrinsics)."""

    def __init__(self, name):
        super().__init__(name=name)


class I8x32Type(_Vec):
    def __init__(self):
        super().__init__("I8x32")


class I16x16Type(_Vec):
    def __init__(self):
        super().__init__("I16x16")


class I32x8Type(_Vec):
    def __init__(self):
        super().__init__("I32x8")


class F32x8Type(_Vec):
    def __init__(self):
        super().__init__("F32x8")


I8x32, I16x16, I32x8, F32x8 = I8x32Type(), I16x16Type(), I32x8Type(), F32x8Type()
_LLTY = {I8x32Type: _V8x32, I16x16Type: _V16x16, I32x8Type: _V32x8, F32x8Type: _F32x8}

for _cls, _llty in _LLTY.items():
    def _model(llty):
        class _Model(models.PrimitiveModel):
            def __init__(self, dmm, fe_type):
                super().__init__(dmm, fe_type, llty)
        return _Model
    register_model(_cls)(_model(_llty))


# -- target features ---------------------------------------------------------------------------------------
def _features(context):
    """The '+feature' names of the target Numba compiles for (the host unless NUMBA_CPU_* say otherwise)."""
    feats = getattr(context.codegen(), "_tm_features", "") or ""
    return {f[1:] for f in feats.split(",") if f.startswith("+")}


# Tests set this to check the generic IR on an AVX2 host (in functions compiled after setting it).
FORCE_GENERIC = [False]


def has_avx2(context):
    return "avx2" in _features(context) and not FORCE_GENERIC[0]


def has_f16c(context):
    return "f16c" in _features(context) and not FORCE_GENERIC[0]


def host_features():
    """The target features of Numba's CPU target, as a set of names (for tests and benchmarks)."""
    from numba.core.registry import cpu_target
    return _features(cpu_target.target_context)


# -- helpers for IR (used by the intrinsics of gemm_f32 and act_quant too) ---------------------------------
def ir_call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def ir_const_vec(llty, values):
    return ir.Constant(llty, [ir.Constant(llty.element, int(v)) for v in values])


def ir_splat(builder, llty, scalar):
    n = llty.count
    v = builder.insert_element(ir.Constant(llty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(llty, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def ir_shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(idx)), [int(i) for i in idx]))


def ir_ptr(context, builder, arrty, arr, off, llty):
    """Pointer (as llty*) to element `off` of array `arr`."""
    ary = context.make_array(arrty)(context, builder, arr)
    p = builder.gep(ary.data, [off])
    return builder.bitcast(p, llty.as_pointer())


def is_bytes_array(a):
    return isinstance(a, types.Array) and a.dtype in (types.uint8, types.int8)


def is_f32_array(a):
    return isinstance(a, types.Array) and a.dtype == types.float32


def ir_intp(context, builder, ty, v):
    return context.cast(builder, v, ty, types.intp)


# -- loads and stores --------------------------------------------------------------------------------------
@intrinsic
def load_i8x32(typingctx, a, off):
    """The 32 bytes a[off:off+32] (uint8/int8 array)."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _V8x32)
        return builder.load(p, align=1)
    return I8x32(a, off), codegen


@intrinsic
def load_nib16(typingctx, a, off):
    """16 bytes a[off:off+16] as 32 nibbles: lanes 0-15 the low nibbles, lanes 16-31 the high ones (block_q4_0)."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), v16)
        v = builder.load(p, align=1)
        lo = builder.and_(v, ir_const_vec(v16, [15] * 16))
        hi = builder.lshr(v, ir_const_vec(v16, [4] * 16))
        return ir_shuffle(builder, lo, hi, range(32))
    return I8x32(a, off), codegen


@intrinsic
def load_bits32(typingctx, a, off, val):
    """The 32 bits of the little-endian uint32 at a[off:off+4] as bytes: lane j = val if bit j is set, else 0."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer) and isinstance(val, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v4 = ir.VectorType(_I8, 4)
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), v4)
        v = builder.load(p, align=1)
        rep = ir_shuffle(builder, v, ir.Constant(v4, ir.Undefined), [j // 8 for j in range(32)])
        bit = builder.and_(rep, ir_const_vec(_V8x32, [1 << (j % 8) for j in range(32)]))
        isset = builder.icmp_unsigned("!=", bit, ir.Constant(_V8x32, None))
        x = builder.trunc(context.cast(builder, args[2], sig.args[2], types.int64), _I8)
        return builder.select(isset, ir_splat(builder, _V8x32, x), ir.Constant(_V8x32, None))
    return I8x32(a, off, val), codegen


@intrinsic
def load_u32(typingctx, a, off):
    """The little-endian uint32 at a[off:off+4] (bytes), as int64."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _I32)
        return builder.zext(builder.load(p, align=1), _I64)
    return types.int64(a, off), codegen


@intrinsic
def load_f16(typingctx, a, off):
    """The little-endian fp16 at a[off:off+2] (bytes) as float32, exact (vcvtph2ps where F16C exists)."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _I16)
        h = builder.load(p, align=1)
        if has_f16c(context):
            return builder.fpext(builder.bitcast(h, ir.HalfType()), _F32)
        # generic: move exponent/mantissa into float32 position, rebias by 2**112; inf/nan get all-ones exp
        h32 = builder.zext(h, _I32)
        em = builder.shl(builder.and_(h32, ir.Constant(_I32, 0x7FFF)), ir.Constant(_I32, 13))
        sign = builder.shl(builder.and_(h32, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 16))
        f = builder.fmul(builder.bitcast(em, _F32), ir.Constant(_F32, 2.0**112))
        exp_mask = ir.Constant(_I32, 0x7C00)
        is_special = builder.icmp_unsigned(">=", builder.and_(h32, exp_mask), exp_mask)
        special = builder.bitcast(builder.or_(em, ir.Constant(_I32, 0x7F800000)), _F32)
        f = builder.select(is_special, special, f)
        return builder.bitcast(builder.or_(builder.bitcast(f, _I32), sign), _F32)
    return types.float32(a, off), codegen


@intrinsic
def load_f16x8(typingctx, a, off):
    """The 8 little-endian fp16 at a[off:off+16] (bytes) as float32 lanes, exact."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_I16, 8)
        off = ir_intp(context, builder, sig.args[1], args[1])
        h = builder.load(ir_ptr(context, builder, sig.args[0], args[0], off, v8), align=1)
        if has_f16c(context):
            return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), _F32x8)
        h32 = builder.zext(h, _V32x8)

        def c(v):
            return ir_const_vec(_V32x8, [v] * 8)
        em = builder.shl(builder.and_(h32, c(0x7FFF)), c(13))
        sign = builder.shl(builder.and_(h32, c(0x8000)), c(16))
        f = builder.fmul(builder.bitcast(em, _F32x8), ir.Constant(_F32x8, [ir.Constant(_F32, 2.0**112)] * 8))
        special = builder.icmp_unsigned(">=", builder.and_(h32, c(0x7C00)), c(0x7C00))
        f = builder.select(special, builder.bitcast(builder.or_(em, c(0x7F800000)), _F32x8), f)
        return builder.bitcast(builder.or_(builder.bitcast(f, _V32x8), sign), _F32x8)
    return F32x8(a, off), codegen


@intrinsic
def load_bf16x8(typingctx, a, off):
    """The 8 little-endian bf16 at a[off:off+16] (bytes) as float32 lanes."""
    if not (is_bytes_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v8 = ir.VectorType(_I16, 8)
        off = ir_intp(context, builder, sig.args[1], args[1])
        h = builder.load(ir_ptr(context, builder, sig.args[0], args[0], off, v8), align=1)
        return builder.bitcast(builder.shl(builder.zext(h, _V32x8), ir_const_vec(_V32x8, [16] * 8)), _F32x8)
    return F32x8(a, off), codegen


@intrinsic
def load_f32x8(typingctx, a, off):
    """a[off:off+8] of a float32 array."""
    if not (is_f32_array(a) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _F32x8)
        return builder.load(p, align=4)
    return F32x8(a, off), codegen


@intrinsic
def store_f32x8(typingctx, a, off, v):
    """a[off:off+8] = v (float32 array)."""
    if not (is_f32_array(a) and isinstance(off, types.Integer) and v == F32x8):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _F32x8)
        builder.store(args[2], p, align=4)
        return context.get_dummy_value()
    return types.none(a, off, v), codegen


@intrinsic
def prefetch(typingctx, a, off):
    """Hint that a[off] will be read soon (llvm.prefetch, read, keep in all cache levels)."""
    if not (isinstance(a, types.Array) and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _I8)
        ir_call(builder, "llvm.prefetch.p0", ir.VoidType(),
              [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(a, off), codegen


# -- float -------------------------------------------------------------------------------------------------
@intrinsic
def cvt_f32(typingctx, v):
    """int32 lanes -> float32 lanes."""
    if v != I32x8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _F32x8)
    return F32x8(v), codegen


@intrinsic
def fma_f32(typingctx, acc, v, s):
    """acc + v * s for a scalar s (fused where the host has FMA)."""
    if not (acc == F32x8 and v == F32x8 and isinstance(s, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        s = context.cast(builder, args[2], sig.args[2], types.float32)
        return ir_call(builder, "llvm.fmuladd.v8f32", _F32x8, [args[1], ir_splat(builder, _F32x8, s), args[0]])
    return F32x8(acc, v, s), codegen


@intrinsic
def fmav_f32(typingctx, acc, a, b):
    """acc + a * b, lanewise (fused where the host has FMA)."""
    if not (acc == F32x8 and a == F32x8 and b == F32x8):
        return None

    def codegen(context, builder, sig, args):
        return ir_call(builder, "llvm.fmuladd.v8f32", _F32x8, [args[1], args[2], args[0]])
    return F32x8(acc, a, b), codegen


@intrinsic
def zero_f32(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_F32x8, None)
    return F32x8(), codegen


@intrinsic
def hsum_f32(typingctx, v):
    """The sum of the 8 float32 lanes (pairwise: (0+4)+(2+6) + (1+5)+(3+7))."""
    if v != F32x8:
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        v4 = builder.fadd(ir_shuffle(builder, v, v, [0, 1, 2, 3]), ir_shuffle(builder, v, v, [4, 5, 6, 7]))
        v2 = builder.fadd(ir_shuffle(builder, v4, v4, [0, 1]), ir_shuffle(builder, v4, v4, [2, 3]))
        return builder.fadd(builder.extract_element(v2, ir.Constant(_I32, 0)),
                            builder.extract_element(v2, ir.Constant(_I32, 1)))
    return types.float32(v), codegen


@intrinsic
def store_scaled(typingctx, a, off, v, s0, b0, s1, b1):
    """a[off:off+32] = v * s + b (float32 array), v's lanes as signed bytes; s, b = s0, b0 for lanes 0-15
    and s1, b1 for lanes 16-31 (fused multiply-add where the host has FMA)."""
    if not (is_f32_array(a) and isinstance(off, types.Integer) and v == I8x32
            and all(isinstance(t, types.Float) for t in (s0, b0, s1, b1))):
        return None

    def codegen(context, builder, sig, args):
        f32x32 = ir.VectorType(_F32, 32)
        sc = [context.cast(builder, args[i], sig.args[i], types.float32) for i in range(3, 7)]
        halves = [0] * 16 + [32] * 16
        s = ir_shuffle(builder, ir_splat(builder, f32x32, sc[0]), ir_splat(builder, f32x32, sc[2]), halves)
        b = ir_shuffle(builder, ir_splat(builder, f32x32, sc[1]), ir_splat(builder, f32x32, sc[3]), halves)
        f = builder.sitofp(builder.sext(args[2], ir.VectorType(_I32, 32)), f32x32)
        r = ir_call(builder, "llvm.fmuladd.v32f32", f32x32, [f, s, b])
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), f32x32)
        builder.store(r, p, align=4)
        return context.get_dummy_value()
    return types.none(a, off, v, s0, b0, s1, b1), codegen


# -- test helpers: vectors from and to arrays ----------------------------------------------------------------
@intrinsic
def load_i16x16(typingctx, a, off):
    """a[off:off+16] of an int16 array (the Q8_K block sums; tests)."""
    if not (isinstance(a, types.Array) and a.dtype == types.int16 and isinstance(off, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _V16x16)
        return builder.load(p, align=2)
    return I16x16(a, off), codegen


@intrinsic
def store_i16x16(typingctx, a, off, v):
    """a[off:off+16] = v for an int16 array (tests)."""
    if not (isinstance(a, types.Array) and a.dtype == types.int16 and v == I16x16):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _V16x16)
        builder.store(args[2], p, align=2)
        return context.get_dummy_value()
    return types.none(a, off, v), codegen


@intrinsic
def store_i32x8(typingctx, a, off, v):
    """a[off:off+8] = v for an int32 array (tests)."""
    if not (isinstance(a, types.Array) and a.dtype == types.int32 and v == I32x8):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _V32x8)
        builder.store(args[2], p, align=4)
        return context.get_dummy_value()
    return types.none(a, off, v), codegen


@intrinsic
def store_i8x32(typingctx, a, off, v):
    """a[off:off+32] = v for a byte array (tests)."""
    if not (is_bytes_array(a) and v == I8x32):
        return None

    def codegen(context, builder, sig, args):
        p = ir_ptr(context, builder, sig.args[0], args[0], ir_intp(context, builder, sig.args[1], args[1]), _V8x32)
        builder.store(args[2], p, align=1)
        return context.get_dummy_value()
    return types.none(a, off, v), codegen
