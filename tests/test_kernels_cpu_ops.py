"""CPU (Numba) non-matmul ops vs numpy float64 references: rms_norm, QK-norm, RoPE, activations, softmax."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_cpu.activations import gelu, geglu, silu, softcap, softmax, swiglu
from kernels_cpu.norm import rms_norm, rms_norm_heads
from kernels_cpu.rope import rope, rope_yarn_corr_dims

# named tolerances (normalized mean squared error unless said otherwise)
NMSE_NORM = 1e-12
NMSE_ROPE = 1e-12  # vs a float64 rotation with ggml's float32 angle recurrence
NMSE_ROPE_EXACT_SMALL_POS = 1e-11  # vs exact float64 angles, positions < 512
NMSE_ROPE_EXACT_BIG_POS = 1e-5  # vs exact float64 angles near position 30000 (float32 theta, as ggml)
NMSE_ACT = 1e-12
RTOL_GELU_F16 = 2e-3  # fp16 table: one fp16 ulp (2^-10 relative) of the looked-up value
NMSE_SOFTMAX = 1e-12


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref ** 2), 1e-300))


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------- rms_norm

def ref_rms_norm(x, w, eps):
    x = x.astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w.astype(np.float64)


@pytest.mark.parametrize("n_tok,n", [(1, 32), (7, 33), (3, 4096), (2, 1)])
@pytest.mark.parametrize("with_w", [True, False])
def test_rms_norm(n_tok, n, with_w):
    rng = np.random.default_rng(n_tok * 1000 + n)
    x, w = randn(rng, n_tok, n, scale=3.0), randn(rng, n)
    w = w if with_w else None
    y = rms_norm(x, w, 1e-6)
    assert y.dtype == np.float32 and y.shape == x.shape and np.isfinite(y).all()
    assert nmse(y, ref_rms_norm(x, w, 1e-6)) < NMSE_NORM
    x2 = x.copy()
    assert rms_norm(x2, w, 1e-6, out=x2) is x2  # in place
    np.testing.assert_array_equal(x2, y)


def test_rms_norm_zero_row_and_eps():
    x = np.zeros((2, 16), dtype=np.float32)
    x[1] = 1e-3
    y = rms_norm(x, None, 1e-5)
    assert np.isfinite(y).all() and not y[0].any()
    assert nmse(y, ref_rms_norm(x, None, 1e-5)) < NMSE_NORM


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rms_norm_heads(head_dim):
    rng = np.random.default_rng(head_dim)
    x, w = randn(rng, 5, 3, head_dim, scale=2.0), randn(rng, head_dim)
    y = rms_norm_heads(x, w, 1e-6)
    assert y.shape == x.shape and np.isfinite(y).all()
    assert nmse(y, ref_rms_norm(x, w, 1e-6)) < NMSE_NORM  # w broadcasts over heads
    x2 = x.copy()
    rms_norm_heads(x2, w, 1e-6, out=x2)
    np.testing.assert_array_equal(x2, y)


def test_rms_norm_checks():
    with pytest.raises(ValueError, match="weight must have 8"):
        rms_norm(np.ones((2, 8), np.float32), np.ones(7, np.float32), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        rms_norm(np.ones((2, 8)), None, 1e-6)


# ---------------------------------------------------------------- rope

def ref_angles(p, n_rot, base, fs, ggml_f32, ff=None):
    """theta_i (float64) for i < n_rot/2: exact, or ggml's float32 recurrence theta *= base^(-2/n_rot)."""
    ff = np.ones(n_rot // 2) if ff is None else ff
    if not ggml_f32:
        return p * fs * base ** (-2.0 * np.arange(n_rot // 2) / n_rot) / ff
    f32 = np.float32
    ts = f32(np.power(f32(base), f32(-2.0) / f32(n_rot)))
    theta, out = f32(p), []
    for i in range(n_rot // 2):
        out.append(float(f32(fs) * f32(theta / f32(ff[i]))))
        theta = f32(theta * ts)
    return np.array(out)


def ref_rope(x, positions, n_rot, base, fs, mode, ggml_f32=True, ff=None, ext=0.0, attn=1.0, corr=(0.0, 0.0)):
    y = x.astype(np.float64).copy()
    half = n_rot // 2
    for t, p in enumerate(positions):
        th = ref_angles(p, n_rot, base, fs, ggml_f32, ff)
        ms = attn
        if ext:
            extrap = th / fs
            ramp = 1 - np.clip((np.arange(half) - corr[0]) / max(0.001, corr[1] - corr[0]), 0, 1)
            mix = ramp * ext
            th = th * (1 - mix) + extrap * mix
            ms = attn * (1 + 0.1 * np.log(1 / fs))
        c, s = np.cos(th) * ms, np.sin(th) * ms
        i0 = np.arange(half) if mode == "neox" else 2 * np.arange(half)
        i1 = i0 + half if mode == "neox" else i0 + 1
        x0, x1 = y[t, :, i0].copy(), y[t, :, i1].copy()  # (half, n_head)
        y[t, :, i0] = x0 * c[:, None] - x1 * s[:, None]
        y[t, :, i1] = x0 * s[:, None] + x1 * c[:, None]
    return y


ROPE_CASES = [  # (n_tok, n_head, head_dim, n_rot, base, freq_scale, p0)
    (1, 4, 64, 64, 10000.0, 1.0, 0),
    (5, 3, 128, 128, 1e6, 1.0, 17),
    (3, 2, 128, 64, 10000.0, 0.25, 100),  # partial rotation, linear scaling
    (4, 2, 256, 256, 1e6, 0.125, 300),
    (2, 1, 96, 32, 500000.0, 1.0, 7),
]


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope(mode, case):
    n_tok, n_head, head_dim, n_rot, base, fs, p0 = case
    rng = np.random.default_rng(head_dim + n_rot + p0)
    x = randn(rng, n_tok, n_head, head_dim)
    pos = np.arange(p0, p0 + n_tok, dtype=np.int32)
    y = rope(x, pos, n_rot, base, fs, mode)
    assert y.shape == x.shape and np.isfinite(y).all()
    np.testing.assert_array_equal(y[..., n_rot:], x[..., n_rot:])  # pass-through dims
    assert nmse(y, ref_rope(x, pos, n_rot, base, fs, mode)) < NMSE_ROPE
    assert nmse(y, ref_rope(x, pos, n_rot, base, fs, mode, ggml_f32=False)) < NMSE_ROPE_EXACT_SMALL_POS
    x2 = x.copy()
    assert rope(x2, pos, n_rot, base, fs, mode, out=x2) is x2  # in place
    np.testing.assert_array_equal(x2, y)


@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_big_positions(mode):
    rng = np.random.default_rng(3)
    x = randn(rng, 4, 2, 128)
    pos = np.array([30000, 30001, 29999, 32767], dtype=np.int32)  # unsorted on purpose
    y = rope(x, pos, 128, 10000.0, 1.0, mode)
    assert np.isfinite(y).all()
    assert nmse(y, ref_rope(x, pos, 128, 10000.0, 1.0, mode)) < NMSE_ROPE
    assert nmse(y, ref_rope(x, pos, 128, 10000.0, 1.0, mode, ggml_f32=False)) < NMSE_ROPE_EXACT_BIG_POS


def test_rope_norm_vs_neox_pairs():
    # a vector nonzero only in dims (0, 1): NORM rotates that pair, NEOX pairs dim 0 with dim n_rot/2
    x = np.zeros((1, 1, 8), np.float32)
    x[0, 0, 0] = 1.0
    a = rope(x, np.array([1]), 8, 10000.0, 1.0, "norm")
    b = rope(x, np.array([1]), 8, 10000.0, 1.0, "neox")
    np.testing.assert_allclose(a[0, 0, :2], [np.cos(1), np.sin(1)], rtol=1e-6)
    np.testing.assert_allclose(b[0, 0, [0, 4]], [np.cos(1), np.sin(1)], rtol=1e-6)


@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_freq_factors_and_yarn(mode):
    rng = np.random.default_rng(5)
    x = randn(rng, 3, 2, 64)
    pos = np.array([0, 5, 200], dtype=np.int32)
    ff = (1.0 + rng.random(32) * 7).astype(np.float32)
    y = rope(x, pos, 64, 500000.0, 1.0, mode, freq_factors=ff)
    assert nmse(y, ref_rope(x, pos, 64, 500000.0, 1.0, mode, ff=ff.astype(np.float64))) < NMSE_ROPE
    corr = rope_yarn_corr_dims(64, 4096, 1e6, 32.0, 1.0)
    assert 0 <= corr[0] <= corr[1] <= 63
    y = rope(x, pos, 64, 1e6, 0.25, mode, ext_factor=1.0, attn_factor=1.0, corr_dims=corr)
    assert np.isfinite(y).all()
    assert nmse(y, ref_rope(x, pos, 64, 1e6, 0.25, mode, ext=1.0, corr=corr)) < NMSE_ROPE


def test_rope_checks():
    x = np.zeros((2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="mode"):
        rope(x, np.arange(2), 8, 1e4, 1.0, "gptj")
    with pytest.raises(ValueError, match="n_rot"):
        rope(x, np.arange(2), 10, 1e4, 1.0, "norm")
    with pytest.raises(ValueError, match="positions"):
        rope(x, np.arange(3), 8, 1e4, 1.0, "norm")


# ---------------------------------------------------------------- activations

def ref_gelu(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * x * (1 + 0.044715 * x * x)))


def ref_silu(x):
    x = x.astype(np.float64)
    return x / (1 + np.exp(-x))


def act_input(rng, shape):
    x = randn(rng, *shape, scale=4.0)
    tails = np.array([0.0, -30.0, 30.0, -100.0], np.float32)  # zero and saturated tails
    x.reshape(-1)[:4] = tails[:x.size]
    return x


@pytest.mark.parametrize("shape", [(1, 1), (3, 257), (2, 5, 64)])
def test_silu_gelu(shape):
    rng = np.random.default_rng(sum(shape))
    x = act_input(rng, shape)
    for fn, ref in ((silu, ref_silu), (gelu, ref_gelu)):
        y = fn(x)
        assert y.shape == x.shape and np.isfinite(y).all()
        assert nmse(y, ref(x)) < NMSE_ACT
        x2 = x.copy()
        fn(x2, out=x2)
        np.testing.assert_array_equal(x2, y)


def test_gelu_f16_table():
    rng = np.random.default_rng(11)
    x = act_input(rng, (4, 300))
    x.reshape(-1)[4:8] = [-10.0, 10.0, -9.99, 12.5]
    y = gelu(x, f16_table=True)
    # ggml_vec_gelu_f32 with GGML_GELU_FP16: 0 at x <= -10, x at x >= 10, else fp16(gelu(fp16(x)))
    # the table holds ggml_gelu_f32 computed in float32 (its x < -5 tail is float32 cancellation, kept as is)
    x16 = x.astype(np.float16).astype(np.float32)
    f = np.float32
    g32 = f(0.5) * x16 * (f(1) + np.tanh(f(0.7978845608) * x16 * (f(1) + f(0.044715) * x16 * x16)))
    ref = np.where(x <= -10, 0.0, np.where(x >= 10, x, g32.astype(np.float16).astype(np.float64)))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=RTOL_GELU_F16, atol=1e-7)
    g = randn(rng, 4, 300)
    np.testing.assert_array_equal(geglu(x, g, f16_table=True), y * g)


@pytest.mark.parametrize("n_ff", [1, 37, 1024])
def test_swiglu_geglu(n_ff):
    rng = np.random.default_rng(n_ff)
    gate, up = act_input(rng, (3, n_ff)), randn(rng, 3, n_ff)
    for fn, act in ((swiglu, ref_silu), (geglu, ref_gelu)):
        y = fn(gate, up)
        assert y.shape == gate.shape and np.isfinite(y).all()
        assert nmse(y, act(gate) * up.astype(np.float64)) < NMSE_ACT
    with pytest.raises(ValueError, match="one shape"):
        swiglu(gate, up[:, :-1] if n_ff > 1 else up[:0])


@pytest.mark.parametrize("cap", [30.0, 50.0])
def test_softcap(cap):
    rng = np.random.default_rng(int(cap))
    x = randn(rng, 3, 1000, scale=40.0)
    y = softcap(x, cap)
    assert np.isfinite(y).all() and np.abs(y).max() <= cap
    assert nmse(y, cap * np.tanh(x.astype(np.float64) / cap)) < NMSE_ACT


# ---------------------------------------------------------------- softmax

@pytest.mark.parametrize("shape", [(1, 1), (4, 33), (2, 3, 1000)])
def test_softmax(shape):
    rng = np.random.default_rng(sum(shape))
    x = randn(rng, *shape, scale=10.0)
    x.reshape(-1)[0] = 80.0  # would overflow exp without the max subtraction
    y = softmax(x)
    xd = x.astype(np.float64)
    e = np.exp(xd - xd.max(axis=-1, keepdims=True))
    assert np.isfinite(y).all()
    assert nmse(y, e / e.sum(axis=-1, keepdims=True)) < NMSE_SOFTMAX
    np.testing.assert_allclose(y.sum(axis=-1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------- serial and parallel variants
# Small inputs (one decode token) run on the calling thread, large ones over the workers: one loop body,
# two compiled drivers. They must agree, whichever side of SERIAL_MAX_ELEMS an input falls on, to float32 rounding
# (LLVM vectorizes and contracts to FMA differently in the two drivers: the norm's float64 sum, rope's x0 c - x1 s).

def test_serial_and_parallel_variants_agree():
    from kernels_cpu import activations, norm, rope as rope_mod  # noqa: PLC0415

    rng = np.random.default_rng(7)
    x, w = randn(rng, 9, 640, scale=3.0), randn(rng, 640)
    outs = [np.empty_like(x) for _ in range(2)]
    norm._rms_norm_rows_serial(x, w, True, np.float32(1e-6), outs[0])
    norm._rms_norm_rows_par(x, w, True, np.float32(1e-6), outs[1])
    np.testing.assert_array_max_ulp(outs[0], outs[1], maxulp=2)
    assert nmse(outs[0], ref_rms_norm(x, w, 1e-6)) < NMSE_NORM

    gate, up = act_input(rng, (5000,)), randn(rng, 5000)
    for op in (0, 1, 2):
        a, b = np.empty_like(gate), np.empty_like(gate)
        activations._glu_serial(gate, up, op, activations.GELU_F16_TABLE, a)
        activations._glu_par(gate, up, op, activations.GELU_F16_TABLE, b)
        np.testing.assert_array_equal(a, b)

    q = randn(rng, 6, 4, 64)
    tables = rope_mod.rope_tables(np.arange(100, 106), 48, 10000.0)
    for neox in (False, True):
        a, b = np.empty_like(q), np.empty_like(q)
        rope_mod._rope_apply_serial(q, tables.cos, tables.sin, 48, neox, a)
        rope_mod._rope_apply_par(q, tables.cos, tables.sin, 48, neox, b)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # |x| ~ 1: one float32 rounding of x0 c - x1 s
        np.testing.assert_array_equal(a, rope(q, np.arange(100, 106), 48, 10000.0, mode="neox" if neox else "norm"))


def test_large_inputs_take_the_parallel_path():
    # above SERIAL_MAX_ELEMS (a prefill batch): still right against the float64 references
    from kernels_cpu.norm import SERIAL_MAX_ELEMS  # noqa: PLC0415

    rng = np.random.default_rng(8)
    n_tok = SERIAL_MAX_ELEMS // 512 + 3
    x, w = randn(rng, n_tok, 1024, scale=3.0), randn(rng, 1024)
    assert nmse(rms_norm(x, w, 1e-6), ref_rms_norm(x, w, 1e-6)) < NMSE_NORM
    gate, up = act_input(rng, (n_tok, 1024)), randn(rng, n_tok, 1024)
    assert nmse(geglu(gate, up), ref_gelu(gate) * up.astype(np.float64)) < NMSE_ACT
