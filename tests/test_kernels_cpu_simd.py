"""The SIMD intrinsics of kernels_cpu.simd (and gemm_f32's micro-kernel) vs numpy, on the host's instructions
and on the generic LLVM IR (FORCE_GENERIC: what a host without AVX2/F16C runs), on random and edge-case bytes."""

import numpy as np
import pytest
from numba import njit

from kernels_cpu import gemm_f32, simd, simd_int

PATHS = ["host", "generic"]


@pytest.fixture(params=PATHS)
def ops(request):
    """Fresh (uncached) test kernels compiled for the requested path."""
    simd.FORCE_GENERIC[0] = request.param == "generic"
    try:
        yield _compile_ops()
    finally:
        simd.FORCE_GENERIC[0] = False


def _compile_ops():
    s, si = simd, simd_int

    @njit
    def maddubs(u, v, out):
        for i in range(u.shape[0] // 32):
            s.store_i16x16(out, 16 * i, si.maddubs(s.load_i8x32(u, 32 * i), s.load_i8x32(v, 32 * i)))

    @njit
    def madd(a, b, out):
        for i in range(a.shape[0] // 16):
            s.store_i32x8(out, 8 * i, si.madd(s.load_i16x16(a, 16 * i), s.load_i16x16(b, 16 * i)))

    @njit
    def dot_signed(w, x, out):
        for i in range(w.shape[0] // 32):
            q, xv = s.load_i8x32(w, 32 * i), s.load_i8x32(x, 32 * i)
            out[i] = si.hsum_i32(si.dot_u8i8(si.abs_i8(q), si.sign_i8(xv, q)))

    @njit
    def sign_abs(w, x, out_sign, out_abs):
        for i in range(w.shape[0] // 32):
            q, xv = s.load_i8x32(w, 32 * i), s.load_i8x32(x, 32 * i)
            s.store_i8x32(out_sign, 32 * i, si.sign_i8(xv, q))
            s.store_i8x32(out_abs, 32 * i, si.abs_i8(q))

    @njit
    def unpack(a, table, out_nib, out_bits, out_lut, out_shift):
        for i in range(a.shape[0] // 32):
            s.store_i8x32(out_nib, 32 * i, s.load_nib16(a, 32 * i))
            s.store_i8x32(out_bits, 32 * i, s.load_bits32(a, 32 * i, 16))
            s.store_i8x32(out_lut, 32 * i, si.lut16_i8(s.load_nib16(a, 32 * i), table, 0))
            v = s.load_i8x32(a, 32 * i)
            s.store_i8x32(out_shift, 32 * i, si.or_i8(si.and_i8(si.shr_i8(v, 3), 5), si.addc_i8(si.shl_i8(v, 2), -7)))

    @njit
    def f16(a, out):
        for i in range(out.shape[0]):
            out[i] = s.load_f16(a, 2 * i)

    @njit
    def f16x8(a, out, bf16):
        for i in range(out.shape[0] // 8):
            v = s.load_bf16x8(a, 16 * i) if bf16 else s.load_f16x8(a, 16 * i)
            s.store_f32x8(out, 8 * i, v)

    @njit
    def scaled(v, out, s0, b0, s1, b1):
        for i in range(v.shape[0] // 32):
            s.store_scaled(out, 32 * i, s.load_i8x32(v, 32 * i), s0, b0, s1, b1)

    @njit
    def fsum(a, scale):
        acc = s.zero_f32()
        sc = np.full(8, scale * np.float32(0.5), dtype=np.float32)
        for i in range(a.shape[0] // 8):
            acc = s.fma_f32(acc, s.load_f32x8(a, 8 * i), scale * np.float32(0.5))
            acc = s.fmav_f32(acc, s.load_f32x8(a, 8 * i), s.load_f32x8(sc, 0))
        tmp = np.empty(8, dtype=np.float32)
        s.store_f32x8(tmp, 0, acc)
        return s.hsum_f32(acc), tmp

    @njit
    def gemm(w, ldw, xp, k_len, c):
        gemm_f32.gemm_tile(w, 0, ldw, xp, 0, k_len, c)

    return dict(maddubs=maddubs, madd=madd, dot_signed=dot_signed, sign_abs=sign_abs, unpack=unpack,
                f16=f16, f16x8=f16x8, scaled=scaled, fsum=fsum, gemm=gemm)


def _bytes(rng, n, dtype):
    info = np.iinfo(dtype)
    v = rng.integers(info.min, info.max + 1, n).astype(dtype)
    v[:8] = [info.min, info.max, 0, 1, -1 if info.min < 0 else 2, info.min, info.max, info.max]
    return v


def test_maddubs_saturates_like_vpmaddubsw(ops):
    rng = np.random.default_rng(0)
    u = _bytes(rng, 32 * 64, np.uint8)
    v = _bytes(rng, 32 * 64, np.int8)
    u[32:64], v[32:64] = 255, 127  # every pair saturates high
    u[64:96], v[64:96] = 255, -128  # and low
    out = np.empty(16 * 64, dtype=np.int16)
    ops["maddubs"](u, v, out)
    p = u.astype(np.int64) * v.astype(np.int64)
    ref = np.clip(p[0::2] + p[1::2], -32768, 32767)
    assert np.array_equal(out, ref)
    assert out[16] == 32767 and out[32] == -32768


def test_madd_pairs_int16_lanes(ops):
    rng = np.random.default_rng(1)
    a, b = _bytes(rng, 16 * 16, np.int16), _bytes(rng, 16 * 16, np.int16)
    a[16:18], b[16:18] = -32768, -32768  # the one overflow: 2**31 wraps to -2**31, as vpmaddwd does
    out = np.empty(8 * 16, dtype=np.int32)
    ops["madd"](a, b, out)
    prod = a.astype(np.int64) * b.astype(np.int64)
    ref = (prod[0::2] + prod[1::2] + 2**31) % 2**32 - 2**31
    assert np.array_equal(out, ref) and out[8] == -(2**31)


def test_signed_dot_is_exact(ops):
    rng = np.random.default_rng(2)
    n = 32 * 100
    w = _bytes(rng, n, np.int8)
    x = rng.integers(-127, 128, n).astype(np.int8)  # Q8 activations never hold -128
    x[:32] = 127
    w[:32] = -128  # |w| = 128: the largest pair sum, 2 * 128 * 127, still fits int16
    out = np.empty(100, dtype=np.int64)
    ops["dot_signed"](w.view(np.uint8), x, out)
    ref = (w.astype(np.int64) * x.astype(np.int64)).reshape(100, 32).sum(1)
    assert np.array_equal(out, ref)


def test_sign_and_abs(ops):
    rng = np.random.default_rng(3)
    w, x = _bytes(rng, 32 * 8, np.int8), _bytes(rng, 32 * 8, np.int8)
    w[8:16] = 0
    out_s, out_a = np.empty(256, np.int8), np.empty(256, np.int8)
    ops["sign_abs"](w, x, out_s, out_a)
    ref_s = np.where(w < 0, -x.astype(np.int16), np.where(w == 0, 0, x)).astype(np.int8)  # wraps -(-128)
    assert np.array_equal(out_s, ref_s)
    assert np.array_equal(out_a.view(np.uint8), np.abs(w.astype(np.int16)).astype(np.uint8))


def test_unpacking_nibbles_bits_tables_shifts(ops):
    rng = np.random.default_rng(4)
    a = rng.integers(0, 256, 32 * 16).astype(np.uint8)
    table = rng.integers(0, 256, 16).astype(np.uint8)
    outs = [np.empty_like(a) for _ in range(4)]
    ops["unpack"](a, table, *outs)
    nib, bits, lut, shift = outs
    blk = a.reshape(-1, 32)[:, :16]
    ref_nib = np.concatenate([blk & 15, blk >> 4], axis=1).reshape(-1)
    assert np.array_equal(nib, ref_nib)
    words = a.reshape(-1, 32)[:, :4].copy().view("<u4")[:, 0].astype(np.int64)
    ref_bits = np.array([[16 if (wd >> j) & 1 else 0 for j in range(32)] for wd in words], np.uint8).reshape(-1)
    assert np.array_equal(bits, ref_bits)
    assert np.array_equal(lut, table[ref_nib])
    ref_shift = ((a >> 3) & 5) | ((a.astype(np.int64) << 2) - 7).astype(np.uint8)
    assert np.array_equal(shift, ref_shift)


def test_load_f16_every_bit_pattern(ops):
    h = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, dtype=np.float32)
    ops["f16"](h.view(np.uint8), out)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(out.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    assert np.isnan(out[nan]).all()


def test_load_f16x8_and_bf16x8_every_bit_pattern(ops):
    h = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, dtype=np.float32)
    ops["f16x8"](h.view(np.uint8), out, False)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(out.view(np.uint32)[~nan], ref.view(np.uint32)[~nan]) and np.isnan(out[nan]).all()
    ops["f16x8"](h.view(np.uint8), out, True)
    assert np.array_equal(out.view(np.uint32), h.astype(np.uint32) << 16)


def test_store_scaled_and_float_reductions(ops):
    rng = np.random.default_rng(5)
    v = _bytes(rng, 32 * 4, np.int8)
    out = np.empty(32 * 4, dtype=np.float32)
    s0, b0, s1, b1 = np.float32(0.5), np.float32(-1.25), np.float32(3.0), np.float32(0.0)
    ops["scaled"](v, out, s0, b0, s1, b1)
    half = (np.arange(32 * 4) % 32) >= 16
    ref = v.astype(np.float32) * np.where(half, s1, s0) + np.where(half, b1, b0)
    assert np.array_equal(out, ref)  # exact: small integers times powers of two
    a = rng.standard_normal(8 * 37).astype(np.float32)
    total, lanes = ops["fsum"](a, np.float32(2.0))
    assert np.allclose(lanes, 2 * a.reshape(-1, 8).sum(0), rtol=1e-5)
    assert total == pytest.approx(2 * a.astype(np.float64).sum(), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("k_len", [0, 1, 7, 256, 301])
def test_gemm_tile_accumulates(ops, k_len):
    rng = np.random.default_rng(6)
    ldw = k_len + 3
    w = rng.standard_normal(6 * ldw).astype(np.float32)
    xp = rng.standard_normal(16 * k_len).astype(np.float32)
    c0 = rng.standard_normal(96).astype(np.float32)
    c = c0.copy()
    ops["gemm"](w, ldw, xp, k_len, c)
    w6 = w.reshape(6, ldw)[:, :k_len].astype(np.float64)
    ref = c0.reshape(6, 16) + w6 @ xp.reshape(k_len, 16).astype(np.float64)
    assert np.allclose(c.reshape(6, 16), ref, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- simd_k: the K-quant scale intrinsics

@pytest.fixture(params=PATHS)
def kops(request):
    simd.FORCE_GENERIC[0] = request.param == "generic"
    try:
        yield _compile_kops()
    finally:
        simd.FORCE_GENERIC[0] = False


def _compile_kops():
    from kernels_cpu import simd_k as k

    s, si = simd, simd_int

    @njit
    def shuffles(words, table, out):  # out (n_words, n_rows, 16) int16
        for i in range(words.shape[0]):
            v = k.scales_from_u64(words[i])
            for r in range(table.shape[0]):
                s.store_i16x16(out[i, r], 0, k.shuffle_scales(v, table, r))

    @njit
    def signed_scales(a, table, out):  # 8 signed bytes per group of a
        for i in range(a.shape[0] // 8):
            v = k.scales_i8x8(a, 8 * i)
            for r in range(table.shape[0]):
                s.store_i16x16(out[i, r], 0, k.shuffle_scales(v, table, r))

    @njit
    def q6_dot(q, x, out):  # maddubs(q, x) - maddubs_32(x): (q - 32) . x pairs
        for i in range(q.shape[0] // 32):
            xv = s.load_i8x32(x, 32 * i)
            s.store_i16x16(out, 16 * i, k.sub_i16(si.maddubs(s.load_i8x32(q, 32 * i), xv), k.maddubs_32(xv)))

    @njit
    def mins_terms(words, bs, out):  # Q4_K/Q5_K: madd of the 8 mins (each twice) with a block's 16 sums
        for i in range(words.shape[0]):
            s.store_i32x8(out, 8 * i, si.madd(k.mins_pairs_from_u64(words[i]), s.load_i16x16(bs, 16 * i)))

    return shuffles, signed_scales, q6_dot, mins_terms


def test_k_scale_shuffles_and_q6_offsets(kops):
    from kernels_cpu import simd_k as k

    shuffles, signed_scales, q6_dot, mins_terms = kops
    rng = np.random.default_rng(5)
    words = rng.integers(0, 1 << 63, 40, dtype=np.int64)
    words[0] = -1  # every byte 255
    out = np.zeros((40, 8, 16), np.int16)
    shuffles(words, k.K4_SCALE_SHUF, out)
    b = words.view(np.uint8).reshape(40, 8).astype(np.int16)  # little-endian bytes, unsigned
    np.testing.assert_array_equal(out, np.repeat(b[:, :, None], 16, axis=2))  # sub-block m: scale m everywhere

    a = rng.integers(-128, 128, 8 * 30, dtype=np.int64).astype(np.int8)
    out6 = np.zeros((30, 4, 16), np.int16)
    signed_scales(a, k.K6_SCALE_SHUF, out6)
    sc = a.reshape(30, 8).astype(np.int16)
    want = np.concatenate([np.repeat(sc[:, 0::2, None], 8, axis=2), np.repeat(sc[:, 1::2, None], 8, axis=2)], axis=2)
    np.testing.assert_array_equal(out6, want)  # group g: scale 2g (first 16 values), 2g + 1 (last 16)

    q = rng.integers(0, 64, 32 * 20).astype(np.uint8)
    q[:32] = 63
    x = rng.integers(-127, 128, 32 * 20).astype(np.int8)
    x[:32] = -127  # the extreme pair sums stay exact
    got16 = np.zeros(16 * 20, np.int16)
    q6_dot(q, x, got16)
    prod = (q.astype(np.int64) - 32) * x.astype(np.int64)
    np.testing.assert_array_equal(got16, prod.reshape(-1, 2).sum(axis=1))

    bs = rng.integers(-2032, 2033, 16 * 40).astype(np.int16)  # sums of 16 int8 activations
    bs[:16] = -2032  # the extremes stay exact
    got32 = np.zeros(8 * 40, np.int32)
    mins_terms(words, bs, got32)
    pairs = bs.astype(np.int64).reshape(40, 8, 2).sum(axis=2)  # sub-block g of 32: sums 2g and 2g + 1
    np.testing.assert_array_equal(got32.reshape(40, 8), b * pairs)  # min g (byte g, unsigned) x its sum
