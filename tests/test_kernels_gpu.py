"""GPU kernels (kernels_gpu) and GpuBackend vs float64 numpy references and vs the CPU backend.

Every test needs a CUDA device through CuPy (marked `gpu`, skipped elsewhere by conftest.py).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import replace

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from gguf_io.quantize_ref import quantize_q4_0, quantize_q8_0  # noqa: E402
from gguf_io.quants import QUANTS  # noqa: E402
from kernels_gpu import GPU_KERNELS  # noqa: E402
from kernels_gpu import ops  # noqa: E402
from kernels_gpu import attention as att  # noqa: E402
from kernels_gpu.attention import attention  # noqa: E402
from kernels_gpu.kv_cache import alloc_kv_layer, kv_store  # noqa: E402
from kernels_gpu.matmul import (Q6S_WARPS, Q8_AUTO, Q8_KERNEL, Q8_MATVEC, Q8_STAGED, Q8T_MMA_TYPES,  # noqa: E402
                                 dequantize, matmul, matmul_many, matmul_mmq, matvec_q8, matvec_q8t, q8_1_reference,
                                 q8t_config, quantize_q8_1, uses_mmq)
from kernels_gpu.module import MODULES, compile_all  # noqa: E402

pytestmark = pytest.mark.gpu

# named tolerances: normalized mean squared error vs float64
NMSE_MATVEC = 1e-9  # f32 activations, weights dequantized exactly in registers, f32 accumulation
# q8 matvec (8-bit activations, dp4a) vs float64 on exact activations: the activations' rounding alone (numpy on
# these random weights, 37-333 rows: median 2.8e-5, max 9.2e-5 in 48 cases); llama.cpp's test-backend-ops limit
# for quantized matmul. Vs float64 on the q8 activations (ref_matmul_q8) the kernels meet NMSE_MATVEC.
NMSE_MATVEC_Q8 = 5e-4
NMSE_GEMM_F32 = 1e-9  # F32 / BF16 weights: fp32 cuBLAS GEMM
NMSE_GEMM_F16 = 1e-5  # quantized / F16 weights: fp16 weights and activations, fp32 accumulation
NMSE_DEQUANT = 1e-13  # dequantized values (FMA contraction may move the last bit)
NMSE_NORM = 1e-12
NMSE_ROPE_SMALL_POS = 5e-8  # float32 angles vs exact float64 angles, positions < 512
NMSE_ROPE_BIG_POS = 1e-5  # near position 30000
NMSE_ACT = 1e-12
NMSE_ATTN = 1e-9  # vs float64 attention over the values the cache holds
NMSE_ATTN_MMA = 2e-6  # the tensor-core prefill kernel: q and the probabilities rounded to f16 (11-bit mantissas)
NMSE_VS_CPU_QUANT = 5e-4  # GPU (f32 activations) vs CPU (q8 activations) matmul on quantized weights
NMSE_VS_CPU = 1e-8
NMSE_ENGINE_VS_CPU_QUANT = 5e-3  # logits after 2 layers: the CPU's q8 activations at every matmul add up (~1e-3)
NMSE_GELU_VS_CPU = 1e-6  # the CPU's gelu goes through ggml's fp16 table; ours is the float formula (as ggml-cuda)

FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
               "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0],
               "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0]}
TYPES = list(GPU_KERNELS)


def nmse(a, ref) -> float:
    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref ** 2), 1e-300))


def random_weight(name: str, n_out: int, n_in: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Raw rows (n_out, row_bytes) uint8 with finite, sane scale fields (times `scale`); row 0 all-zero bytes
    when n_out > 2."""
    spec = QUANTS[name]
    n = n_out * n_in // spec.block_size
    if name == "F32":
        raw = rng.standard_normal(n).astype(np.float32).view(np.uint8)
    elif name == "F16":
        raw = rng.standard_normal(n).astype(np.float16).view(np.uint8)
    elif name == "BF16":
        raw = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(n, spec.type_size), dtype=np.uint8)
        for off, s in zip(FP16_FIELDS.get(name, ()), (0.05 * scale, 0.02 * scale)):
            raw[:, off:off + 2] = rng.uniform(-s, s, (n, 1)).astype("<f2").view(np.uint8)
        if name == "MXFP4":  # e8m0 scale 2**(e - 128): 2**-10 .. 2**-6 (times a power of two near `scale`)
            raw[:, 0] = rng.integers(118, 123, n) + int(np.round(np.log2(scale)))
        elif name == "IQ1_M":  # fp16 d spread over the top nibbles of the 4 u16 scales (bytes 48..56)
            d = rng.uniform(-0.05 * scale, 0.05 * scale, n).astype("<f2").view("<u2")
            sc = raw[:, 48:56].copy().view("<u2")
            for k in range(4):
                nib = (d >> np.uint16(4 * k)) & np.uint16(0xF)
                sc[:, k] = (sc[:, k] & np.uint16(0x0FFF)) | (nib << np.uint16(12))
            raw[:, 48:56] = sc.view(np.uint8)
    raw = np.ascontiguousarray(raw.reshape(n_out, -1))
    if n_out > 2:
        raw[0] = 0
    return raw


def ref_matmul(raw: np.ndarray, name: str, x: np.ndarray) -> np.ndarray:
    w = QUANTS[name].dequantize(raw).astype(np.float64)
    return x.astype(np.float64) @ w.T


def ref_matmul_q8(raw: np.ndarray, name: str, x: np.ndarray) -> np.ndarray:
    """float64 dequantize(W) @ the activations the q8 kernels see (x rounded by q8_1_reference)."""
    q, d = q8_1_reference(x)
    xq = (q.astype(np.float64).reshape(*d.shape, 32) * d[..., None]).reshape(x.shape)
    return ref_matmul(raw, name, xq)


def n_in_values(name: str) -> list[int]:
    bs = QUANTS[name].block_size
    if bs == 1:
        return [1, 7, 64, 1000, 1030]
    return [bs, 3 * bs, 5 * bs] if bs == 256 else [bs, 3 * bs, 40 * bs]


# ---------------------------------------------------------------- compilation

def test_every_module_compiles():
    errors = {name: msg for name, msg in compile_all().items() if msg}
    assert not errors, "\n\n".join(f"{name}:\n{msg}" for name, msg in errors.items())
    assert set(compile_all()) == set(MODULES)


def test_registry_matches_the_reference_dequantizers():
    assert set(GPU_KERNELS) == set(QUANTS)
    for name, k in GPU_KERNELS.items():
        assert (k.block_size, k.type_size) == (QUANTS[name].block_size, QUANTS[name].type_size)


# ---------------------------------------------------------------- matmul

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n_tok", [1, 2, 3, 8, 11])
def test_matvec(name, n_tok):
    rng = np.random.default_rng(zlib.crc32(f"{name}{n_tok}".encode()))
    for n_out, n_in in [(1, n_in_values(name)[0]), (37, n_in_values(name)[1]), (300, n_in_values(name)[2]),
                        (1001, n_in_values(name)[-1])]:
        raw = random_weight(name, n_out, n_in, rng)
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        out = cupy.full((n_tok, n_out), np.nan, dtype=cupy.float32)  # poison: every output must be written
        y = matmul(cupy.asarray(raw), name, cupy.asarray(x), out=out, path="matvec", q8=False).get()
        assert np.isfinite(y).all(), (name, n_out, n_in)
        assert nmse(y, ref_matmul(raw, name, x)) < NMSE_MATVEC, (name, n_out, n_in)
        if n_out > 2:
            assert not y[:, 0].any()  # the all-zero row


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("wpr", [1, 2, 4, 8])
def test_matvec_warps_per_row(name, wpr):
    rng = np.random.default_rng(7 + wpr)
    n_in = n_in_values(name)[-1]
    raw = random_weight(name, 45, n_in, rng)
    for n_tok, rpws in ((1, (1, 2, 4)), (2, (None,)), (4, (None,)), (7, (None,))):
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        for rpw in rpws:
            y = matmul(cupy.asarray(raw), name, cupy.asarray(x), path="matvec", wpr=wpr, rpw=rpw, q8=False).get()
            assert nmse(y, ref_matmul(raw, name, x)) < NMSE_MATVEC, (n_tok, rpw)


def test_quantize_q8_1_matches_reference():
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((3, 1024)) * rng.uniform(0.01, 100, (3, 1024 // 32)).repeat(32, 1)).astype(np.float32)
    x[1, 64:96] = 0  # an all-zero block
    x[2, 0:32] = np.arange(32) - 15.5  # a hand-built block: amax 15.5
    xq, xm = quantize_q8_1(cupy.asarray(x))
    q, d = q8_1_reference(x)
    np.testing.assert_array_equal(xq.get(), q)
    m = xm.get()  # (3, 32, 4)
    np.testing.assert_array_equal(m[..., 0], d)
    qb = q.astype(np.int64).reshape(3, -1, 32)
    np.testing.assert_array_equal(m[..., 1], qb[..., :16].sum(-1))
    np.testing.assert_array_equal(m[..., 2], qb[..., 16:].sum(-1))
    assert not q[1, 64:96].any() and d[1, 2] == 0
    assert q[2, 0] == -127 and q[2, 31] == 127


@pytest.mark.parametrize("name", list(Q8_MATVEC))
def test_matvec_q8(name):
    rng = np.random.default_rng(zlib.crc32(f"q8{name}".encode()))
    for n_out, n_in in [(1, 256), (37, 768), (300, 1280), (1001, 1280), (4099, 512)]:  # 768: odd blocks; Q6_K rows
        raw = random_weight(name, n_out, n_in, rng)  # of 630 bytes start 2 bytes off 4-byte alignment
        x = rng.standard_normal((1, n_in)).astype(np.float32)
        out = cupy.full((1, n_out), np.nan, dtype=cupy.float32)
        y = matmul(cupy.asarray(raw), name, cupy.asarray(x), out=out, path="matvec", q8=True).get()
        assert np.isfinite(y).all(), (name, n_out, n_in)
        assert nmse(y, ref_matmul_q8(raw, name, x)) < NMSE_MATVEC, (name, n_out, n_in)
        if n_out >= 37:  # nmse of a few rows is too noisy to bound
            assert nmse(y, ref_matmul(raw, name, x)) < NMSE_MATVEC_Q8, (name, n_out, n_in)
        if n_out > 2:
            assert not y[:, 0].any()  # the all-zero row
        y1 = matmul(cupy.asarray(raw), name, cupy.asarray(x[0])).get()  # 1-D x, the default path
        ref1 = ref_matmul_q8(raw, name, x)[0] if name in Q8_AUTO else ref_matmul(raw, name, x)[0]
        assert y1.shape == (n_out,) and nmse(y1, ref1) < NMSE_MATVEC


@pytest.mark.parametrize("name", list(Q8_MATVEC))
@pytest.mark.parametrize("wpr", [1, 2, 4, 8])
def test_matvec_q8_warps_per_row(name, wpr):
    rng = np.random.default_rng(70 + wpr)
    raw = random_weight(name, 45, 1280, rng)
    x = rng.standard_normal((1, 1280)).astype(np.float32)
    ref = ref_matmul_q8(raw, name, x)
    xq, xm = quantize_q8_1(cupy.asarray(x))
    for kernel in ("warp", "staged") if name in Q8_STAGED else ("warp",):
        for rpw in (1, 2, 4):
            if kernel == "staged" and (rpw > 2 or wpr > Q6S_WARPS):  # 1-2 rows a warp, Q6S_WARPS warps a CTA
                continue
            y = cupy.full((1, 45), np.nan, dtype=cupy.float32)
            matvec_q8(cupy.asarray(raw), name, xq, xm, y, wpr=wpr, rpw=rpw, kernel=kernel)
            assert nmse(y.get(), ref) < NMSE_MATVEC, (kernel, rpw, wpr)
            if Q8_KERNEL[name] == kernel:  # matmul's q8 path takes the default kernel
                y = matmul(cupy.asarray(raw), name, cupy.asarray(x), path="matvec", wpr=wpr, rpw=rpw, q8=True)
                assert nmse(y.get(), ref) < NMSE_MATVEC, (rpw, wpr)


@pytest.mark.parametrize("name", list(Q8_MATVEC))
@pytest.mark.parametrize("n_tok", [2, 3, 5, 8])
def test_matvec_q8_several_tokens(name, n_tok):
    """matvec_q8t (the weights loaded once for 2-8 tokens of q8 activations), every design and split, against float64
    on the q8 activations; each token's row of the dp4a designs against the one-token kernel (the same sums in the
    same order: within 1e-6 of the row's largest value), the tensor-core designs (the same integer sums of a
    sub-block, scaled and added in another order) within 1e-5 of float64's largest value; matmul takes the default
    for these types."""
    rng = np.random.default_rng(zlib.crc32(f"q8t{name}{n_tok}".encode()))
    for n_out, n_in in [(1, 256), (37, 768), (300, 1280), (1001, 1280), (4099, 512)]:
        raw = cupy.asarray(random_weight(name, n_out, n_in, rng))
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        xq, xm = quantize_q8_1(cupy.asarray(x))
        ref = ref_matmul_q8(raw.get(), name, x)
        configs = [("dp4a", 2), ("dp4a", 4)] + ([("mma", None)] if name in Q8T_MMA_TYPES else [])
        for kernel, rpw in [(None, None), *configs]:
            for wpr in (None, 1, 2, 4, 8):
                y = cupy.full((n_tok, n_out), np.nan, dtype=cupy.float32)  # poison: every output must be written
                matvec_q8t(raw, name, xq, xm, y, wpr=wpr, rpw=rpw, kernel=kernel)
                y = y.get()
                cfg = q8t_config(name, n_out, n_tok, kernel, rpw, wpr)
                what = (n_out, n_in, *cfg)
                assert np.isfinite(y).all(), what
                assert nmse(y, ref) < NMSE_MATVEC, what
                if cfg[0] == "mma":  # other float32 order: within 1e-5 of the largest |y| of float64's
                    err = float(np.abs(y - ref).max() / np.abs(ref).max())
                    assert err <= 1e-5, (*what, err)
                    continue
                for t in range(n_tok):  # the one-token kernel's sums in the same order, same split of a row
                    one = cupy.empty((1, n_out), dtype=cupy.float32)
                    matvec_q8(raw, name, xq[t:t + 1], xm[t:t + 1], one, rpw=2, wpr=cfg[2], kernel="warp")
                    one = one.get()[0]
                    err = float(np.abs(y[t] - one).max() / max(float(np.abs(one).max()), 1e-30))
                    assert err <= 1e-6, (*what, t, err)
        auto = matmul(raw, name, cupy.asarray(x)).get()  # the default path of 2-8 tokens
        assert nmse(auto, ref_matmul_q8(raw.get(), name, x)) < NMSE_MATVEC


@pytest.mark.parametrize("name", Q8T_MMA_TYPES)
@pytest.mark.parametrize("n_tok", [2, 5, 8, 9, 16, 23, 32, 41, 64])
def test_matmul_mmq(name, n_tok):
    """The tensor-core kernel over 2-64 tokens (column groups of 8 sharing each unpacked weight fragment), every
    split of a row tile and 1 or 2 row tiles a warp, against float64 on the q8 activations (within 1e-5 of its
    largest value, as the 2-8 token kernel); from 9 tokens matmul's default path and matmul_many (beside a Q5_K
    weight, which keeps the GEMM) take it."""
    rng = np.random.default_rng(zlib.crc32(f"mmq{name}{n_tok}".encode()))
    for n_out, n_in in [(1, 256), (37, 768), (300, 1280), (4099, 512)]:
        raw = cupy.asarray(random_weight(name, n_out, n_in, rng))
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        xq, xm = quantize_q8_1(cupy.asarray(x))
        ref = ref_matmul_q8(raw.get(), name, x)
        for wpr in (None, 1, 2, 4, 8):
            for rt in (None, 1, 2):
                y = cupy.full((n_tok, n_out), np.nan, dtype=cupy.float32)  # poison: every output must be written
                matmul_mmq(raw, name, xq, xm, y, wpr=wpr, rt=rt)
                y = y.get()
                assert np.isfinite(y).all(), (n_out, n_in, wpr, rt)
                err = float(np.abs(y - ref).max() / np.abs(ref).max())
                assert err <= 1e-5, (n_out, n_in, wpr, rt, err)
        if n_tok >= 9:
            auto = matmul(raw, name, cupy.asarray(x)).get()
            assert uses_mmq(name, n_tok)
            assert float(np.abs(auto - ref).max() / np.abs(ref).max()) <= 1e-5
    if n_tok < 9:
        return
    q5 = random_weight("Q5_K", 300, 1280, rng)
    x = rng.standard_normal((n_tok, 1280)).astype(np.float32)
    raw = random_weight(name, 500, 1280, rng)
    assert not uses_mmq("Q5_K", n_tok)
    ya, yb = matmul_many([cupy.asarray(raw), cupy.asarray(q5)], [name, "Q5_K"], cupy.asarray(x))
    assert float(np.abs(ya.get() - ref_matmul_q8(raw, name, x)).max()) <= 1e-5 * np.abs(ya.get()).max()
    assert nmse(yb.get(), ref_matmul(q5, "Q5_K", x)) < NMSE_GEMM_F16


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n_tok", [16, 64])
def test_gemm(name, n_tok):
    rng = np.random.default_rng(zlib.crc32(f"gemm{name}{n_tok}".encode()))
    for n_out, n_in in [(37, n_in_values(name)[1]), (300, n_in_values(name)[-1])]:
        raw = random_weight(name, n_out, n_in, rng)
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        out = cupy.full((n_tok, n_out), np.nan, dtype=cupy.float32)
        y = matmul(cupy.asarray(raw), name, cupy.asarray(x), out=out, path="gemm").get()
        assert np.isfinite(y).all()
        tol = NMSE_GEMM_F32 if name in ("F32", "BF16") else NMSE_GEMM_F16
        assert nmse(y, ref_matmul(raw, name, x)) < tol, (name, n_out, n_in)


def test_matmul_1d_auto_and_checks():
    rng = np.random.default_rng(3)
    raw = random_weight("Q4_K", 64, 512, rng)
    x = rng.standard_normal(512).astype(np.float32)
    y = matmul(cupy.asarray(raw), "Q4_K", cupy.asarray(x))  # one token: the q8 path by default
    assert y.shape == (64,)
    assert nmse(y.get(), ref_matmul_q8(raw, "Q4_K", x[None])[0]) < NMSE_MATVEC
    with pytest.raises(ValueError):
        matmul(cupy.asarray(raw), "Q4_K", cupy.asarray(x[:256]))
    with pytest.raises(ValueError):
        matmul(raw, "Q4_K", cupy.asarray(x))  # host weight
    from gguf_io.errors import UnsupportedQuantType

    with pytest.raises(UnsupportedQuantType):
        matmul(cupy.asarray(raw), "Q9_9", cupy.asarray(x))


def test_expert_slices():
    rng = np.random.default_rng(5)
    raw = np.stack([random_weight("Q4_K", 40, 512, rng) for _ in range(3)])  # (n_expert, out, row_bytes)
    dev = cupy.asarray(raw)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    for e in range(3):
        y = matmul(dev[e], "Q4_K", cupy.asarray(x)).get()  # 2 tokens: the q8 several-token matvec by default
        assert nmse(y, ref_matmul_q8(raw[e], "Q4_K", x)) < NMSE_MATVEC
        y = matmul(dev[e], "Q4_K", cupy.asarray(x), q8=False).get()
        assert nmse(y, ref_matmul(raw[e], "Q4_K", x)) < NMSE_MATVEC


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_rows(name):
    rng = np.random.default_rng(11)
    raw = random_weight(name, 50, n_in_values(name)[1], rng)
    ids = np.array([3, 0, 49, 3, 17], dtype=np.int32)
    got = dequantize(cupy.asarray(raw), name, rows=cupy.asarray(ids)).get()
    ref = QUANTS[name].dequantize(raw[ids])
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert nmse(got, ref) < NMSE_DEQUANT
    if not GPU_KERNELS[name].is_float:
        h = dequantize(cupy.asarray(raw), name, dtype=np.float16).get()
        np.testing.assert_allclose(h.astype(np.float32), QUANTS[name].dequantize(raw), rtol=1e-3, atol=1e-6)


# ---------------------------------------------------------------- ops

def ref_rms(x, w, eps):
    x = x.astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w.astype(np.float64)


# 2880: no float4 CTA shape (rms_norm_f32); 1024 on: a CTA a row in registers (rms_norm_vec*)
@pytest.mark.parametrize("n_tok,n",
                         [(1, 32), (7, 33), (3, 4096), (2, 1), (9, 1024), (1, 5120), (1, 2880), (2, 32768), (3, 16384)])
@pytest.mark.parametrize("with_w", [True, False])
def test_rms_norm(n_tok, n, with_w):
    rng = np.random.default_rng(n_tok * 1000 + n)
    x = (rng.standard_normal((n_tok, n)) * 3).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32) if with_w else None
    y = ops.rms_norm(cupy.asarray(x), None if w is None else cupy.asarray(w), 1e-6).get()
    assert np.isfinite(y).all() and nmse(y, ref_rms(x, w, 1e-6)) < NMSE_NORM


def test_rms_norm_heads():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 8, 128)).astype(np.float32)
    w = rng.standard_normal(128).astype(np.float32)
    y = ops.rms_norm_heads(cupy.asarray(x), w, 1e-6).get()  # a host weight works too
    assert nmse(y, ref_rms(x, w, 1e-6)) < NMSE_NORM


def ref_rope(x, pos, n_rot, base, fscale, mode):
    x = x.astype(np.float64)
    out = x.copy()
    half = n_rot // 2
    i = np.arange(half)
    theta = pos[:, None].astype(np.float64) * fscale * base ** (-2.0 * i / n_rot)  # (n_tok, half)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    i0, i1 = (i, i + half) if mode == "neox" else (2 * i, 2 * i + 1)
    out[:, :, i0] = x[:, :, i0] * c - x[:, :, i1] * s
    out[:, :, i1] = x[:, :, i0] * s + x[:, :, i1] * c
    return out


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("hd,n_rot", [(64, 64), (128, 128), (128, 64), (256, 256)])
@pytest.mark.parametrize("fscale", [1.0, 0.25])
def test_rope(mode, hd, n_rot, fscale):
    rng = np.random.default_rng(hd + n_rot)
    x = rng.standard_normal((6, 4, hd)).astype(np.float32)
    pos = np.array([0, 1, 2, 100, 300, 511], dtype=np.int32)
    y = ops.rope(cupy.asarray(x), cupy.asarray(pos), n_rot, 10000.0, fscale, mode).get()
    assert nmse(y, ref_rope(x, pos, n_rot, 10000.0, fscale, mode)) < NMSE_ROPE_SMALL_POS
    np.testing.assert_array_equal(y[:, :, n_rot:], x[:, :, n_rot:])
    pos_big = np.array([29990, 30000, 30001, 31000, 32000, 32767], dtype=np.int32)
    y = ops.rope(cupy.asarray(x), cupy.asarray(pos_big), n_rot, 1e6, fscale, mode).get()
    assert nmse(y, ref_rope(x, pos_big, n_rot, 1e6, fscale, mode)) < NMSE_ROPE_BIG_POS


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("hd,n_rot,n_head,n_head_kv", [(128, 128, 32, 4), (128, 64, 8, 8), (256, 256, 4, 1),
                                                     (64, 64, 3, 1)])
def test_qk_norm_rope_equals_the_four_ops(mode, hd, n_rot, n_head, n_head_kv):
    """The one-kernel QK-norm + RoPE (qwen3's attention) against rms_norm_heads then rope of q and k."""
    rng = np.random.default_rng(hd + n_head)
    n_tok = 5
    q = (rng.standard_normal((n_tok, n_head, hd)) * 3).astype(np.float32)
    k = (rng.standard_normal((n_tok, n_head_kv, hd)) * 3).astype(np.float32)
    wq, wk = (rng.standard_normal(hd).astype(np.float32) for _ in range(2))
    pos = cupy.asarray(np.array([0, 7, 100, 4095, 32767], dtype=np.int32))
    gq, gk = ops.qk_norm_rope(cupy.asarray(q), cupy.asarray(k), cupy.asarray(wq), cupy.asarray(wk), 1e-6, pos,
                              n_rot, 1e6, 1.0, mode)
    for got, x, w in ((gq, q, wq), (gk, k, wk)):
        ref = ops.rope(ops.rms_norm_heads(cupy.asarray(x), cupy.asarray(w), 1e-6), pos, n_rot, 1e6, 1.0, mode)
        np.testing.assert_allclose(got.get(), ref.get(), rtol=1e-6, atol=1e-6)  # the same arithmetic
    with pytest.raises(ValueError, match="head_dim"):
        ops.qk_norm_rope(cupy.zeros((1, 2, 512), cupy.float32), cupy.zeros((1, 1, 512), cupy.float32),
                         cupy.zeros(512, cupy.float32), cupy.zeros(512, cupy.float32), 1e-6, pos[:1], 512, 1e4)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_glu(act):
    rng = np.random.default_rng(2)
    g = (rng.standard_normal((3, 1000)) * 4).astype(np.float32)
    u = rng.standard_normal((3, 1000)).astype(np.float32)
    g64 = g.astype(np.float64)
    if act == "silu":
        a = g64 / (1 + np.exp(-g64))
    else:
        a = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * g64 * (1 + 0.044715 * g64 * g64)))
    y = ops.glu(cupy.asarray(g), cupy.asarray(u), act).get()
    assert nmse(y, a * u) < NMSE_ACT


def test_scale():
    x = np.random.default_rng(4).standard_normal((3, 77)).astype(np.float32)
    np.testing.assert_array_equal(ops.scale(cupy.asarray(x), 0.125).get(), x * np.float32(0.125))


# ---------------------------------------------------------------- KV cache and attention

def _ref_rows(raw: np.ndarray, type_name: str, hd: int) -> np.ndarray:
    """Cache bytes (n, n_head_kv, row_bytes) -> the float64 values they hold (n, n_head_kv, hd)."""
    if type_name == "f32":
        v = raw.view(np.float32)
    elif type_name == "f16":
        v = raw.view(np.float16)
    else:
        v = QUANTS[type_name.upper()].dequantize(raw)
    return v.astype(np.float64).reshape(raw.shape[0], raw.shape[1], hd)


@pytest.mark.parametrize("type_k,type_v,hd_v", [("f32", "f32", 64), ("f16", "f16", 64), ("q8_0", "q8_0", 64),
                                              ("q4_0", "q4_0", 64), ("q8_0", "f16", 64), ("f16", "q4_0", 32),
                                              ("f32", "q8_0", 96)])
def test_kv_store_matches_ggml_reference(type_k, type_v, hd_v):
    """k and v (one launch, kv_store_kv) of any two types and head sizes, as ggml encodes them."""
    rng = np.random.default_rng(9)
    n_ctx, n_kv, hd = 20, 3, 64
    layer = alloc_kv_layer(n_ctx, n_kv, hd, hd_v, type_k, type_v)
    k = (rng.standard_normal((5, n_kv, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((5, n_kv, hd_v)).astype(np.float32)
    k[0, 0, :32] = 0  # an all-zero block
    k[1, 1, :32] = -1.5  # ties in |x|
    v[2, 2, :32] = 0
    pos = np.array([4, 0, 19, 7, 8], dtype=np.int32)
    kv_store(layer, cupy.asarray(pos), cupy.asarray(k), cupy.asarray(v))
    enc = {"f32": lambda a: a.view(np.uint8), "f16": lambda a: a.astype(np.float16).view(np.uint8),
           "q8_0": quantize_q8_0, "q4_0": quantize_q4_0}
    got_k, got_v = layer.k.get(), layer.v.get()
    for t, p in enumerate(pos):
        np.testing.assert_array_equal(got_k[p], enc[type_k](k[t]).reshape(n_kv, -1))
        np.testing.assert_array_equal(got_v[p], enc[type_v](v[t]).reshape(n_kv, -1))
    untouched = np.setdiff1d(np.arange(n_ctx), pos)
    assert not got_k[untouched].any() and not got_v[untouched].any()


def ref_attention(q, kv_k, kv_v, pos, scale, n_swa):
    """float64: q (n, H, d), cache values (n_ctx, Hkv, d) -> (n, H, d)."""
    n, H, d = q.shape
    g = H // kv_k.shape[1]
    out = np.zeros((n, H, d))
    for t in range(n):
        p = int(pos[t])
        c = np.arange(p + 1)
        if n_swa > 0:
            c = c[p - c < n_swa]
        for h in range(H):
            kk, vv = kv_k[c, h // g], kv_v[c, h // g]
            s = (kk @ q[t, h].astype(np.float64)) * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ vv
    return out


def _attention_case(type_k, type_v, hd, n_head, n_head_kv, pos, n_swa, rng, n_ctx=None):
    n_ctx = n_ctx or int(pos.max()) + 8
    layer = alloc_kv_layer(n_ctx, n_head_kv, hd, hd, type_k, type_v)
    k = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
    kv_store(layer, cupy.arange(n_ctx, dtype=cupy.int32), cupy.asarray(k), cupy.asarray(v))
    q = rng.standard_normal((len(pos), n_head, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    out = cupy.full((len(pos), n_head, hd), np.nan, dtype=cupy.float32)
    y = attention(cupy.asarray(q), layer, cupy.asarray(pos), int(pos.max()) + 1, scale, n_swa, out=out).get()
    ref = ref_attention(q, _ref_rows(layer.k.get(), type_k, hd), _ref_rows(layer.v.get(), type_v, hd), pos,
                        scale, n_swa)
    assert np.isfinite(y).all()
    return nmse(y, ref)


KV_PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f32", "f32"), ("q8_0", "f16")]


@pytest.mark.parametrize("type_k,type_v", KV_PAIRS)
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_attention(type_k, type_v, hd, group):
    rng = np.random.default_rng(hd * 10 + group)
    n_head_kv = 2
    n_head = n_head_kv * group
    decode = np.array([700], dtype=np.int32)  # one query, many splits
    prefill = np.arange(0, 37, dtype=np.int32)  # a batch from position 0
    chunk = np.arange(300, 333, dtype=np.int32)  # a batch after earlier cells
    for pos, n_swa in ((decode, 0), (prefill, 0), (chunk, 0), (chunk, 50), (decode, 100)):
        err = _attention_case(type_k, type_v, hd, n_head, n_head_kv, pos, n_swa, rng)
        mma = len(pos) >= att.PREFILL_MIN_TOK and att.uses_mma(hd, type_k, type_v)  # the default kernel's rounding
        assert err < (NMSE_ATTN_MMA if mma else NMSE_ATTN), (pos[0], len(pos), n_swa, err)


@pytest.mark.parametrize("hd,n_head,n_head_kv", [(32, 4, 1), (96, 14, 2), (192, 16, 1), (128, 28, 4), (128, 64, 4)])
def test_attention_odd_groups_and_dims(hd, n_head, n_head_kv):
    rng = np.random.default_rng(hd + n_head)
    for pos, n_swa in ((np.array([129], dtype=np.int32), 0), (np.arange(5, 25, dtype=np.int32), 7)):
        assert _attention_case("f16", "q8_0", hd, n_head, n_head_kv, pos, n_swa, rng) < NMSE_ATTN


def _prefill_case(type_k, type_v, hd, n_head, n_head_kv, pos, n_swa, rng, prefill, splits=None, mma=False,
                  sinks=None):
    """nmse of the forced kernel (the fp32 tiled one unless mma) vs float64 on a cache filled over [0, max(pos) + 8);
    with sinks, against the fp32 kernel's output instead."""
    n_ctx = int(pos.max()) + 8
    layer = alloc_kv_layer(n_ctx, n_head_kv, hd, hd, type_k, type_v)
    k = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
    kv_store(layer, cupy.arange(n_ctx, dtype=cupy.int32), cupy.asarray(k), cupy.asarray(v))
    q = rng.standard_normal((len(pos), n_head, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    out = cupy.full((len(pos), n_head, hd), np.nan, dtype=cupy.float32)
    extra = {} if sinks is None else {"sinks": cupy.asarray(sinks)}
    y = attention(cupy.asarray(q), layer, cupy.asarray(pos), int(pos.max()) + 1, scale, n_swa, out=out,
                  prefill=prefill, splits=splits, mma=mma, **extra).get()
    if sinks is not None:
        ref = attention(cupy.asarray(q), layer, cupy.asarray(pos), int(pos.max()) + 1, scale, n_swa, prefill=prefill,
                        splits=1, mma=False, **extra).get()
    else:
        ref = ref_attention(q, _ref_rows(layer.k.get(), type_k, hd), _ref_rows(layer.v.get(), type_v, hd), pos,
                            scale, n_swa)
    assert np.isfinite(y).all()
    return nmse(y, ref)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("n_head,n_head_kv", [(8, 2), (4, 2), (7, 1), (6, 6), (32, 8)])
def test_attention_prefill_mma(hd, n_head, n_head_kv):
    """The tensor-core prefill kernel (f16 cache) vs float64: from position 0, after a prefix, windows, odd row
    counts, gaps (tiles with unseen keys), split key ranges (a chunk late in a context), and with sinks against the
    fp32 kernel; q and the probabilities are rounded to f16 (NMSE_ATTN_MMA)."""
    rng = np.random.default_rng(hd * 11 + n_head)
    cases = ((np.arange(0, 16, dtype=np.int32), 0), (np.arange(37, 137, dtype=np.int32), 0),
             (np.arange(37, 137, dtype=np.int32), 50), (np.arange(3, 20, dtype=np.int32), 5),
             (np.array([0, 1, 5, 9, 64, 65, 66, 130], dtype=np.int32), 0), (np.arange(1500, 1560, dtype=np.int32), 0))
    for pos, n_swa in cases:
        for splits in (1, 5, 16):
            err = _prefill_case("f16", "f16", hd, n_head, n_head_kv, pos, n_swa, rng, True, splits, mma=True)
            assert err < NMSE_ATTN_MMA, (hd, pos[0], len(pos), n_swa, splits, err)
    sinks = rng.standard_normal(n_head).astype(np.float32)
    for splits in (1, 7):
        err = _prefill_case("f16", "f16", hd, n_head, n_head_kv, np.arange(40, 100, dtype=np.int32), 0, rng, True,
                            splits, mma=True, sinks=sinks)
        assert err < NMSE_ATTN_MMA, (hd, splits, err)
    with pytest.raises(ValueError, match="tensor-core"):
        _prefill_case("q8_0", "q8_0", hd, n_head, n_head_kv, np.arange(0, 16, dtype=np.int32), 0, rng, True, mma=True)


@pytest.mark.parametrize("type_k,type_v", KV_PAIRS)
@pytest.mark.parametrize("hd", [64, 128, 192, 256])
@pytest.mark.parametrize("n_head,n_head_kv", [(8, 2), (4, 2), (7, 1), (6, 6)])
def test_attention_prefill_kernel(type_k, type_v, hd, n_head, n_head_kv):
    """The tiled prefill kernel (forced) vs float64: from position 0, after a prefix, windows, odd row counts."""
    rng = np.random.default_rng(hd * 7 + n_head)
    cases = ((np.arange(0, 16, dtype=np.int32), 0), (np.arange(37, 137, dtype=np.int32), 0),
             (np.arange(37, 137, dtype=np.int32), 50), (np.arange(3, 20, dtype=np.int32), 5),
             (np.array([0, 1, 5, 9, 64, 65, 66, 130], dtype=np.int32), 0))  # gaps: tiles with unseen keys
    for pos, n_swa in cases:
        err = _prefill_case(type_k, type_v, hd, n_head, n_head_kv, pos, n_swa, rng, True)
        assert err < NMSE_ATTN, (type_k, type_v, hd, pos[0], len(pos), n_swa, err)


@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "q4_0")])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_attention_prefill_split_keys(type_k, type_v, hd):
    """The prefill kernel with each tile's keys split over CTAs (a short chunk late in a long context), vs float64:
    windows, and gaps that leave splits without a key of some rows or of the whole tile."""
    rng = np.random.default_rng(hd + len(type_k))
    chunk = np.arange(1500, 1540, dtype=np.int32)
    gaps = np.array([0, 3, 64, 700, 701, 1200, 1201, 1202, 1530], dtype=np.int32)
    for pos, n_swa in ((chunk, 0), (chunk, 300), (gaps, 0), (gaps, 100)):
        for splits in (2, 5, 16):
            err = _prefill_case(type_k, type_v, hd, 8, 2, pos, n_swa, rng, True, splits)
            assert err < NMSE_ATTN, (hd, pos[0], len(pos), n_swa, splits, err)


def test_attention_prefill_splits_auto_and_sinks():
    """Few row tiles over many keys split by default (no split when the tiles fill the GPU); with attention sinks
    the split kernel (attn_combine adds the sink) matches the unsplit one."""
    from kernels_gpu import attention as att

    rng = np.random.default_rng(5)
    n_ctx, hd = 2048, 128
    layer = alloc_kv_layer(n_ctx, 2, hd, hd, "f16", "f16")
    kv_store(layer, cupy.arange(n_ctx, dtype=cupy.int32), cupy.asarray(rng.standard_normal((n_ctx, 2, hd)),
                                                                      cupy.float32),
             cupy.asarray(rng.standard_normal((n_ctx, 2, hd)), cupy.float32))
    pos = cupy.arange(n_ctx - 32, n_ctx, dtype=cupy.int32)
    q = cupy.asarray(rng.standard_normal((32, 8, hd)), cupy.float32)
    n_tiles = -(-32 * 4 // att.ATTP_BQ) * 2  # row tiles x KV heads: 4 CTAs
    want = min(-(-att.TARGET_CTAS // n_tiles), n_ctx // att.PREFILL_SPLIT_MIN_KEYS)
    for mma in (False, True):  # the fp32 kernel, then the tensor cores' (f16 probabilities: each split its own max)
        tol = NMSE_ATTN_MMA if mma else 1e-12
        auto = attention(q, layer, pos, n_ctx, 0.1, mma=mma).get()
        np.testing.assert_array_equal(auto, attention(q, layer, pos, n_ctx, 0.1, prefill=True, splits=want,
                                                      mma=mma).get())
        assert nmse(auto, attention(q, layer, pos, n_ctx, 0.1, prefill=True, splits=1, mma=mma).get()) < tol
        sinks = cupy.asarray(rng.standard_normal(8), cupy.float32)
        one = attention(q, layer, pos, n_ctx, 0.1, prefill=True, splits=1, sinks=sinks, mma=mma).get()
        split = attention(q, layer, pos, n_ctx, 0.1, prefill=True, splits=7, sinks=sinks, mma=mma).get()
        assert nmse(split, one) < tol


def test_attention_prefill_is_auto_above_threshold():
    from kernels_gpu import attention as att

    rng = np.random.default_rng(3)
    pos = np.arange(10, 10 + att.PREFILL_MIN_TOK, dtype=np.int32)
    layer = alloc_kv_layer(64, 2, 128, 128, "f16", "f16")
    kv_store(layer, cupy.arange(64, dtype=cupy.int32), cupy.asarray(rng.standard_normal((64, 2, 128)), cupy.float32),
             cupy.asarray(rng.standard_normal((64, 2, 128)), cupy.float32))
    q = cupy.asarray(rng.standard_normal((len(pos), 8, 128)), cupy.float32)
    p = cupy.asarray(pos)
    auto = attention(q, layer, p, 64, 0.1).get()
    new = attention(q, layer, p, 64, 0.1, prefill=True).get()
    old = attention(q, layer, p, 64, 0.1, prefill=False).get()
    np.testing.assert_array_equal(auto, new)
    assert att.uses_mma(128, "f16", "f16")  # the default for an f16 cache: the tensor cores
    assert nmse(new, old) < NMSE_ATTN_MMA
    assert nmse(attention(q, layer, p, 64, 0.1, prefill=True, mma=False).get(), old) < 1e-12
    with pytest.raises(ValueError, match="prefill kernel"):
        attention(cupy.zeros((16, 4, 96), cupy.float32), alloc_kv_layer(32, 2, 96), p, 32, 0.1, prefill=True)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_glu_vectorized_matches(act):
    rng = np.random.default_rng(4)
    g = cupy.asarray((rng.standard_normal((33, 4096)) * 3).astype(np.float32))
    u = cupy.asarray(rng.standard_normal((33, 4096)).astype(np.float32))
    a = ops.glu(g, u, act, vec=True).get()
    b = ops.glu(g, u, act, vec=False).get()
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- GpuBackend vs CpuBackend

@pytest.fixture(scope="module")
def backends():
    pytest.importorskip("numba")  # the CPU backend's kernels
    from hybrid.backends.cpu import CpuBackend
    from hybrid.backends.gpu import GpuBackend

    return CpuBackend(), GpuBackend()


@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "IQ4_XS", "MXFP4", "IQ3_S", "IQ1_M"])
@pytest.mark.parametrize("n_tok", [1, 5, 40])
def test_backend_matmul_vs_cpu(backends, name, n_tok):
    from hybrid.model.weights import Weight

    cpu, gpu = backends
    rng = np.random.default_rng(17)
    raw = random_weight(name, 96, 512, rng)
    w = Weight("w", name, (96, 512), raw)
    x = rng.standard_normal((n_tok, 512)).astype(np.float32)
    y_cpu = cpu.matmul(w, x)
    y_gpu = gpu.to_host(gpu.matmul(gpu.upload(w), gpu.from_host(x)))
    tol = NMSE_VS_CPU if name == "F32" else NMSE_VS_CPU_QUANT
    assert nmse(y_gpu, y_cpu) < tol


def test_backend_quantizes_a_shared_input_once(backends, monkeypatch):
    # q, k, v (and gate, up) multiply one x: the backend quantizes it once; results equal separate matmuls
    import kernels_gpu.matmul as gm
    from hybrid.model.weights import Weight

    _, gpu = backends
    rng = np.random.default_rng(29)
    ws = [gpu.upload(Weight(f"w{i}", "Q4_K", (n, 512), random_weight("Q4_K", n, 512, rng))) for i, n in
          enumerate((64, 96, 64))]
    x = gpu.from_host(rng.standard_normal((1, 512)).astype(np.float32))
    calls = []
    real = gm.quantize_q8_1
    monkeypatch.setattr(gm, "quantize_q8_1", lambda a: calls.append(1) or real(a))
    ys = [gpu.to_host(gpu.matmul(w, x)) for w in ws]
    assert len(calls) == 1  # one quantization for the three weights
    x2 = x * 2  # a new input is quantized anew
    y2 = gpu.to_host(gpu.matmul(ws[0], x2))
    assert len(calls) == 2
    for w, y in zip(ws, ys):
        np.testing.assert_array_equal(y, matmul(w.raw, "Q4_K", x, q8=True).get())
    np.testing.assert_array_equal(y2, matmul(ws[0].raw, "Q4_K", x2, q8=True).get())


def test_backend_ops_vs_cpu(backends):
    cpu, gpu = backends
    rng = np.random.default_rng(23)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    w = rng.standard_normal(256).astype(np.float32)
    assert nmse(gpu.to_host(gpu.rms_norm(gpu.from_host(x), w, 1e-5)), cpu.rms_norm(x, w, 1e-5)) < NMSE_VS_CPU
    h = x.reshape(7, 2, 128)
    pos = np.arange(40, 47, dtype=np.int32)
    assert nmse(gpu.to_host(gpu.rms_norm_heads(gpu.from_host(h), w[:128], 1e-5)),
                cpu.rms_norm_heads(h, w[:128], 1e-5)) < NMSE_VS_CPU
    for mode in ("norm", "neox"):
        assert nmse(gpu.to_host(gpu.rope(gpu.from_host(h), pos, 128, 10000.0, 1.0, mode)),
                    cpu.rope(h.copy(), pos, 128, 10000.0, 1.0, mode)) < NMSE_VS_CPU
    for act, tol in (("silu", NMSE_VS_CPU), ("gelu", NMSE_GELU_VS_CPU)):
        assert nmse(gpu.to_host(gpu.glu(gpu.from_host(x), gpu.from_host(w[None] * x), act)),
                    cpu.glu(x, w[None] * x, act)) < tol
    assert nmse(gpu.to_host(gpu.scale(gpu.from_host(x), 0.3)), cpu.scale(x, 0.3)) < NMSE_VS_CPU


@pytest.mark.parametrize("type_kv", ["f16", "q8_0", "q4_0", "f32"])
def test_backend_attention_vs_cpu(backends, type_kv):
    from types import SimpleNamespace

    cpu, gpu = backends
    rng = np.random.default_rng(29)
    n_head, n_head_kv, hd, n_ctx = 8, 2, 128, 64
    kv_c = SimpleNamespace(layers=[cpu.new_kv_layer(n_ctx, n_head_kv, hd, hd, type_kv, type_kv)])
    kv_g = SimpleNamespace(layers=[gpu.new_kv_layer(n_ctx, n_head_kv, hd, hd, type_kv, type_kv)])
    for pos in (np.arange(0, 20, dtype=np.int32), np.array([20], dtype=np.int32), np.arange(21, 30, dtype=np.int32)):
        k = rng.standard_normal((len(pos), n_head_kv, hd)).astype(np.float32)
        v = rng.standard_normal((len(pos), n_head_kv, hd)).astype(np.float32)
        q = rng.standard_normal((len(pos), n_head, hd)).astype(np.float32)
        cpu.kv_store(kv_c, 0, k, v, pos)
        gpu.kv_store(kv_g, 0, gpu.from_host(k), gpu.from_host(v), pos)
        np.testing.assert_array_equal(gpu.to_host(kv_g.layers[0].k), kv_c.layers[0].k)
        np.testing.assert_array_equal(gpu.to_host(kv_g.layers[0].v), kv_c.layers[0].v)
        mma = len(pos) >= att.PREFILL_MIN_TOK and att.uses_mma(hd, type_kv, type_kv)  # f16 q and probabilities
        for n_swa in (0, 8):
            y_c = cpu.attention(q, kv_c, 0, pos, 0.088, n_swa)
            y_g = gpu.to_host(gpu.attention(gpu.from_host(q), kv_g, 0, pos, 0.088, n_swa))
            assert nmse(y_g, y_c) < (NMSE_ATTN_MMA if mma else NMSE_VS_CPU)


def test_backend_transfers(backends):
    _, gpu = backends
    rng = np.random.default_rng(31)
    for shape in [(3,), (1000, 1000), (5, 4096)]:  # small (pageable) and staged (pinned) paths
        x = rng.standard_normal(shape).astype(np.float32)
        d = gpu.from_host(x)
        assert isinstance(d, cupy.ndarray) and gpu.from_host(d) is d
        np.testing.assert_array_equal(gpu.to_host(d), x)
    big = rng.integers(0, 256, size=(3, 40 << 20), dtype=np.uint8)  # > one staging chunk
    np.testing.assert_array_equal(gpu._stager.to_device(big).get(), big)


@pytest.mark.parametrize("arch,wtype", [("llama", "Q8_0"), ("qwen2", "F32"), ("qwen2", "Q8_0"), ("qwen3", "F32"),
                                        ("gemma3", "Q4_0"), ("gemma3", "F32")])
def test_engine_layers_gpu_vs_cpu(tmp_path, arch, wtype):
    """A tiny synthetic model: all layers on the GPU vs all on the CPU give the same logits."""
    from gguf_factory import tiny_model, write_gguf

    from hybrid.backends.gpu import GpuBackend
    from hybrid.engine import Engine, EngineParams

    md, ts = tiny_model(arch, n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, weight_type=wtype)
    rng = np.random.default_rng(37)
    ts = [replace(t, data=random_weight(wtype, int(t.ne[1]), int(t.ne[0]), rng, scale=0.1).tobytes())
          if t.ggml_type == wtype and wtype != "F32" else t for t in ts]  # sane fp16 scales
    path = write_gguf(tmp_path / f"{arch}.gguf", md, ts)
    eng = Engine.load(path, EngineParams(repack=False))  # its CPU weights go to the GPU below: the file's layout
    try:
        tokens = [1, 5, 9, 3, 7, 11, 2, 30, 4]
        ref = eng.eval(tokens, eng.new_cache(64), logits_from=0)
        gpu = GpuBackend()
        eng.backends = [gpu] * eng.config.n_layer
        eng.weights.layers = [{k: gpu.upload(w) for k, w in lw.items()} for lw in eng.weights.layers]
        cache = eng.new_cache(64)
        got = np.concatenate([eng.eval(tokens[:6], cache, logits_from=0), eng.eval(tokens[6:], cache, logits_from=0)])
        tol = NMSE_VS_CPU if wtype == "F32" else NMSE_ENGINE_VS_CPU_QUANT
        assert np.isfinite(got).all() and nmse(got, ref) < tol
    finally:
        eng.close()


def test_engine_offload_all_layers(tmp_path):
    """Engine.load with -ngl all (placement + upload by the engine) agrees with the CPU-only engine."""
    from gguf_factory import tiny_model, write_gguf

    from hybrid.engine import Engine, EngineParams

    md, ts = tiny_model("qwen3", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, weight_type="F32")
    path = write_gguf(tmp_path / "q3.gguf", md, ts)
    tokens = [1, 5, 9, 3, 7, 11, 2, 30, 4]
    cpu = Engine.load(path, EngineParams(n_ctx=64))
    gpu = Engine.load(path, EngineParams(n_ctx=64, n_gpu_layers="all"))
    try:
        ref = cpu.eval(tokens, cpu.new_cache(), logits_from=0)
        cache = gpu.new_cache()
        got = np.concatenate([gpu.eval(tokens[:5], cache, logits_from=0), gpu.eval(tokens[5:], cache, logits_from=0)])
        assert np.isfinite(got).all() and nmse(got, ref) < NMSE_VS_CPU
    finally:
        cpu.close()
        gpu.close()


# ---------------------------------------------------------------- decode steps as CUDA graphs

def _slots_for(layer):
    """Two device uint64 slots holding layer.k / layer.v's addresses -> (array, (k slot, v slot))."""
    s = cupy.asarray(np.array([layer.k.data.ptr, layer.v.data.ptr], dtype=np.uint64))
    return s, (s.data.ptr, s.data.ptr + 8)


@pytest.mark.parametrize("type_kv", ["f16", "q8_0"])
@pytest.mark.parametrize("n_ctx", [40, 700, 4096])
def test_attention_dynamic_split_and_slots(type_kv, n_ctx):
    """The graph-mode launch (grid from the cache size, key chunks from the device positions, cache read
    through slots) gives the eager launch's result at every position, with and without a sliding window."""
    rng = np.random.default_rng(n_ctx)
    n_head, n_head_kv, hd = 8, 2, 128
    layer = alloc_kv_layer(n_ctx, n_head_kv, hd, hd, type_kv, type_kv)
    k = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
    kv_store(layer, cupy.arange(n_ctx, dtype=cupy.int32), cupy.asarray(k), cupy.asarray(v))
    slots, sl = _slots_for(layer)
    for p in sorted(q for q in {0, 1, 63, 64, 65, n_ctx // 2, n_ctx - 1} if q < n_ctx):
        pos = cupy.asarray(np.array([p], dtype=np.int32))
        q = cupy.asarray(rng.standard_normal((1, n_head, hd)).astype(np.float32))
        for n_swa in (0, 30):
            ref = attention(q, layer, pos, p + 1, 0.09, n_swa).get()
            for s in (None, sl):
                out = cupy.full((1, n_head, hd), np.nan, dtype=cupy.float32)
                got = attention(q, layer, pos, n_ctx, 0.09, n_swa, out=out, dynamic=True, slots=s).get()
                assert np.isfinite(got).all()
                assert nmse(got, ref) < 1e-12, (p, n_swa, s is not None)


@pytest.mark.parametrize("hd,n_head", [(128, 8), (64, 6), (96, 4)])
def test_attention_q8_output_is_quantize_q8_1_of_it(hd, n_head):
    """attention_q8 (the decode launch): where the keys are split, attn_combine also writes the output's 8-bit
    quantization, the bytes quantize_q8_1 makes of it; the output itself is attention's."""
    from kernels_gpu.attention import attention_q8
    from kernels_gpu.matmul import quantize_q8_1

    rng = np.random.default_rng(hd)
    n_ctx, n_head_kv = 256, 2
    layer = alloc_kv_layer(n_ctx, n_head_kv, hd, hd, "f16", "f16")
    k = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_ctx, n_head_kv, hd)).astype(np.float32)
    kv_store(layer, cupy.arange(n_ctx, dtype=cupy.int32), cupy.asarray(k), cupy.asarray(v))
    pos = cupy.asarray(np.array([200], dtype=np.int32))
    q = cupy.asarray(rng.standard_normal((1, n_head, hd)).astype(np.float32))
    out, q8 = attention_q8(q, layer, pos, n_ctx, 0.09, dynamic=True, q8=True)
    assert q8 is not None  # 256 keys: split
    ref = attention(q, layer, pos, n_ctx, 0.09, dynamic=True)
    np.testing.assert_array_equal(out.get(), ref.get())
    rq, rm = quantize_q8_1(ref.reshape(1, n_head * hd))
    np.testing.assert_array_equal(q8[0].get(), rq.get())
    np.testing.assert_array_equal(q8[1].get(), rm.get())
    assert attention_q8(q, layer, pos, n_ctx, 0.09, dynamic=True)[1] is None  # not asked


@pytest.mark.parametrize("type_name", ["f32", "f16", "q8_0", "q4_0"])
def test_kv_store_through_slots(type_name):
    rng = np.random.default_rng(5)
    a = alloc_kv_layer(16, 2, 64, 64, type_name, type_name)
    b = alloc_kv_layer(16, 2, 64, 64, type_name, type_name)
    k = rng.standard_normal((3, 2, 64)).astype(np.float32)
    v = rng.standard_normal((3, 2, 64)).astype(np.float32)
    pos = cupy.asarray(np.array([3, 9, 15], dtype=np.int32))
    kv_store(a, pos, cupy.asarray(k), cupy.asarray(v))
    slots, sl = _slots_for(b)
    kv_store(a, pos, cupy.asarray(k), cupy.asarray(v), slots=sl)  # `a` describes the shape, the slots say where
    np.testing.assert_array_equal(b.k.get(), a.k.get())
    np.testing.assert_array_equal(b.v.get(), a.v.get())


def _host_break_step(runner, calls, fail_at=None):
    """A step with a host break: y = 2x to pinned memory, the host adds 1 (fn), 3x computed beside it on the GPU,
    the host's result back: 5x + 1. fail_at: the host call of that number raises."""
    mem_in, mem_out = cupy.cuda.alloc_pinned_memory(32), cupy.cuda.alloc_pinned_memory(32)
    h_in, h_out = np.frombuffer(mem_in, np.float32, 8), np.frombuffer(mem_out, np.float32, 8)
    rt = cupy.cuda.runtime

    def step(x, pos, slots):
        st = cupy.cuda.get_current_stream()
        y = x * 2
        rt.memcpyAsync(h_in.ctypes.data, y.data.ptr, 32, rt.memcpyDeviceToHost, st.ptr)
        z = []

        def fn():
            calls.append(len(calls) + 1)
            if fail_at is not None and len(calls) == fail_at:
                raise ValueError("host call failed")
            h_out[:] = h_in + 1

        runner.host_break(fn, beside=lambda: z.append(x * 3))
        back = cupy.empty((1, 8), dtype=cupy.float32)
        rt.memcpyAsync(back.data.ptr, h_out.ctypes.data, 32, rt.memcpyHostToDevice, st.ptr)
        return back + z[0]

    step.buffers = (mem_in, mem_out)  # alive while the step is
    return step


def test_graph_runner_host_breaks_in_one_graph():
    """A step with a host break is captured as one graph (the host signalled and answered through flags in pinned
    memory) and replays with new inputs; a failing host call raises and leaves the runner usable."""
    from kernels_gpu.graph import GraphRunner

    runner = GraphRunner()
    assert runner._sync is not None  # the H200 has unified addressing
    calls: list = []
    step = _host_break_step(runner, calls)
    for i in range(6):
        x = np.arange(8, dtype=np.float32)[None] + i
        np.testing.assert_array_equal(runner.run("hb", step, x, i, []), 5 * x + 1, err_msg=f"step {i}")
    st = runner.stats
    assert (st.captured, st.eager) == (1, 1) and st.replays == 5 and st.pieces == 5, (runner.report(), st)
    assert len(calls) == 6
    entry = next(iter(runner._entries.values()))
    assert len(entry.pieces) == 1 and entry.pieces[0][0] is None  # one graph, not pieces

    bad_calls: list = []
    bad = _host_break_step(runner, bad_calls, fail_at=4)
    for i in range(5):
        x = np.full((1, 8), i, dtype=np.float32)
        if i == 3:
            with pytest.raises(ValueError, match="host call failed"):
                runner.run("bad", bad, x, i, [])
            continue
        np.testing.assert_array_equal(runner.run("bad", bad, x, i, []), 5 * x + 1, err_msg=f"bad step {i}")
    np.testing.assert_array_equal(runner.run("hb", step, np.ones((1, 8), np.float32), 0, []), 6.0)


def test_graph_runner_host_break_waits_only_when_needed():
    """A break whose `needs` holds no negative value does not hold the replayed step: a copy launched after it lands
    while the host call still runs. With a negative value the step waits for the answer. The callable a host fn
    returns runs after it, every step."""
    from kernels_gpu.graph import GraphRunner

    runner = GraphRunner()
    mem = cupy.cuda.alloc_pinned_memory(32)
    mark = np.frombuffer(mem, np.float32, 8)
    rt = cupy.cuda.runtime
    log: list = []
    landed: list = []

    def step(x, pos, slots):
        st = cupy.cuda.get_current_stream()
        needs = x[0, :2].astype(cupy.int32)

        def fn():
            log.append("fn")
            want, limit = mark_want[0], (0.2 if mark_want[1] else 5.0)
            t0 = time.perf_counter()
            while mark[0] != want and time.perf_counter() - t0 < limit:
                pass
            landed.append(bool(mark[0] == want))
            return lambda: log.append("after")

        runner.host_break(fn, needs=needs)
        rt.memcpyAsync(mark.ctypes.data, x.data.ptr + 8, 4, rt.memcpyDeviceToHost, st.ptr)  # x[0, 2], after it
        return x * 2

    mark_want = [0.0, False]
    for i in range(6):
        wait = i % 2 == 0  # run 0 too: it is eager (the copy is launched after the call), so the mark never lands
        x = np.array([[-1.0 if wait else 0.0, 3.0, 10.0 + i, 0, 0, 0, 0, 0]], dtype=np.float32)
        mark[0] = -5.0
        mark_want[:] = [10.0 + i, wait]
        np.testing.assert_array_equal(runner.run("needs", step, x, i, []), 2 * x)
        assert mark[0] == 10.0 + i
    assert log == ["fn", "after"] * 6
    assert landed[1:] == [True, False, True, False, True], landed  # runs 1-5 replay one graph
    assert runner.stats.replays == 5


def test_graph_runner_replays_for_new_inputs_and_falls_back():
    from kernels_gpu.graph import CaptureUnsupported, GraphRunner

    runner = GraphRunner()
    w = cupy.asarray(np.arange(8, dtype=np.float32))
    cache = cupy.zeros((4, 8), dtype=cupy.float32)

    def step(x, pos, slots):  # y = x * w + pos, and a write through a slot-free buffer
        return ops.scale(x, 2.0) * w + pos.astype(cupy.float32)

    for i in range(5):
        x = np.full((1, 8), i, dtype=np.float32)
        got = runner.run("k", step, x, i, [cache.data.ptr])
        np.testing.assert_array_equal(got, x * 2 * np.arange(8, dtype=np.float32) + i,
                                      err_msg=f"step {i}: {runner.report()} {runner.stats}")
    st = runner.stats
    assert (st.captured, st.replays, st.eager) == (1, 4, 1), (runner.report(), st)
    assert not runner.fallback, runner.report()

    def bad(x, pos, slots):
        if runner.capturing:
            raise CaptureUnsupported("not capturable: a host round trip")
        return x + 1

    for i in range(3):
        np.testing.assert_array_equal(runner.run("bad", bad, np.zeros((1, 8), np.float32), i, []), 1,
                                      err_msg=f"bad step {i}: {runner.report()}")
    assert runner.fallback and "host round trip" in runner.report(), runner.report()
    # the good key still replays
    np.testing.assert_array_equal(runner.run("k", step, np.ones((1, 8), np.float32), 7, [cache.data.ptr]),
                                  (2 * np.arange(8, dtype=np.float32) + 7)[None])
