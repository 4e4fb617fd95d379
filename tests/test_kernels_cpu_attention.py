"""KV cache storage (quantizers bit-exact with gguf-py) and CPU attention over it vs numpy float64 references."""

from __future__ import annotations

import gguf
import gguf.quants
import numba
import numpy as np
import pytest

import kernels_cpu.attention as attention_module
from kernels_cpu.attention import attention
from kernels_cpu.kv_cache import (
    alloc_kv_layer, f32_to_f16_bits, fp32_to_fp16_bits, kv_read, kv_row_bytes, kv_store,
    quantize_row_q4_0,
    quantize_row_q8_0,
)

# named tolerances (normalized mean squared error of the attention output)
NMSE_EXACT = 1e-10  # vs float64 attention over the values the cache holds (f32, or the dequantized cache)
NMSE_F16_VS_F32 = 1e-6  # f16 cache vs the unquantized K/V
NMSE_Q8_0_VS_F32 = 5e-4  # q8_0 cache vs the unquantized K/V
NMSE_Q4_0_VS_F32 = 1e-1  # q4_0 cache vs the unquantized K/V
LOOSE = {"f32": NMSE_EXACT, "f16": NMSE_F16_VS_F32, "q8_0": NMSE_Q8_0_VS_F32, "q4_0": NMSE_Q4_0_VS_F32}
KV_TYPES = ["f32", "f16", "q8_0", "q4_0"]
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref ** 2), 1e-300))


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------- storage

def test_fp32_to_fp16_bits_matches_numpy():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    edges = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e9, 6.1035156e-05, 6.1035152e-05, 5.96e-08,
                      2.98e-08, 2.9802322e-08, 1e-30, 1.0009765625, 1.00048828125, 1.00146484375, -3.5e-6],
                     dtype=np.float32)
    x = np.concatenate([x, edges, -edges, rng.standard_normal(10_000).astype(np.float32) * 1e-5])
    ours = np.array([fp32_to_fp16_bits(v) for v in x], dtype=np.uint16)
    with np.errstate(over="ignore"):  # numpy warns on the values that round to inf; so does ggml silently
        expected = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(ours, expected)
    # the CPU's own conversion (F16C's vcvtps2ph where present), as the KV store and the GELU table use it
    native = np.empty(x.shape, np.uint16)
    _f16_bits_loop(x, native)
    np.testing.assert_array_equal(native, expected)


@numba.njit
def _f16_bits_loop(x, out):
    for i in range(x.shape[0]):
        out[i] = f32_to_f16_bits(x[i])


def quant_input(rng, n_rows, n):
    x = randn(rng, n_rows, n, scale=2.0)
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = np.linspace(-1, 1, 32)  # +-max tie: the first one wins (q4_0)
    x[1, 32:64] = 3.0 * np.sign(np.arange(32) - 15.5)
    x[2, :32] *= 1e-7  # tiny scale: subnormal fp16 d
    x[2, 32:64] *= 1e4  # big values
    return x


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_quantizers_bit_exact(name):
    rng = np.random.default_rng(1)
    x = quant_input(rng, 9, 256)
    fn = quantize_row_q8_0 if name == "q8_0" else quantize_row_q4_0
    out = np.zeros((9, kv_row_bytes(name, 256)), np.uint8)
    for r in range(9):
        fn(x[r], out[r])
    np.testing.assert_array_equal(out, gguf.quants.quantize(x, GGML[name]))


@pytest.mark.parametrize("type_k,type_v", [(t, t) for t in KV_TYPES] + [("q8_0", "f16"), ("f32", "q4_0")])
def test_kv_store_read_roundtrip(type_k, type_v):
    rng = np.random.default_rng(2)
    n_ctx, n_head_kv, dk, dv = 11, 3, 64, 96
    layer = alloc_kv_layer(n_ctx, n_head_kv, dk, dv, type_k, type_v)
    assert layer.nbytes == n_ctx * n_head_kv * (kv_row_bytes(type_k, dk) + kv_row_bytes(type_v, dv))
    k, v = randn(rng, 4, n_head_kv, dk), randn(rng, 4, n_head_kv, dv)
    pos = np.array([7, 0, 3, 10])
    kv_store(layer, pos, k, v)
    k2, v2 = kv_read(layer, 0, n_ctx)
    for want, got, t in ((k, k2[pos], type_k), (v, v2[pos], type_v)):
        if t == "f32":
            ref = want
        elif t == "f16":
            ref = want.astype(np.float16).astype(np.float32)
        else:
            ref = gguf.quants.dequantize(gguf.quants.quantize(want, GGML[t]), GGML[t])
        np.testing.assert_array_equal(got, ref)
    assert not k2[[1, 2, 4, 5, 6, 8, 9]].any()  # untouched cells stay zero


def test_kv_checks():
    layer = alloc_kv_layer(4, 2, 32, type_k="q4_0", type_v="q8_0")
    with pytest.raises(ValueError, match="positions"):
        kv_store(layer, np.array([4]), np.zeros((1, 2, 32), np.float32), np.zeros((1, 2, 32), np.float32))
    with pytest.raises(ValueError, match="found -1"):
        kv_store(layer, np.array([0, -1]), np.ones((2, 2, 32), np.float32), np.ones((2, 2, 32), np.float32))
    assert not layer.k.any() and not layer.v.any()  # a refused store writes nothing
    with pytest.raises(ValueError, match="k must be"):
        kv_store(layer, np.array([0]), np.zeros((1, 2, 64), np.float32), np.zeros((1, 2, 32), np.float32))
    with pytest.raises(ValueError, match="divisible"):
        alloc_kv_layer(4, 2, 48, type_k="q8_0")
    with pytest.raises(ValueError, match="one of"):
        kv_row_bytes("q5_0", 64)


# ---------------------------------------------------------------- attention

def ref_attention(q, k, v, positions, scale, n_swa=0, softcap=0.0):
    """float64: q (n_tok, n_head, dk), k (n_kv, n_head_kv, dk), v (n_kv, n_head_kv, dv) -> (n_tok, n_head, dv)."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    n_tok, n_head, _ = q.shape
    group = n_head // k.shape[1]
    kh, vh = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # (n_kv, n_head, d)
    out = np.zeros((n_tok, n_head, v.shape[2]))
    keys = np.arange(k.shape[0])
    for t, p in enumerate(positions):
        visible = (keys <= p) & ((p - keys < n_swa) if n_swa > 0 else True)
        s = np.einsum("hd,khd->hk", q[t], kh[visible]) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[t] = np.einsum("hk,khd->hd", w / w.sum(axis=1, keepdims=True), vh[visible])
    return out


def run_case(type_k, type_v, head_dim, n_head, n_head_kv, n_tok, p0, n_swa=0, softcap=0.0, seed=0):
    """Fill cells [0, p0 + n_tok) with random K/V, attend the batch at positions p0.. -> (out, q, k, v, layer)."""
    rng = np.random.default_rng(seed)
    n_kv = p0 + n_tok
    layer = alloc_kv_layer(n_kv + 3, n_head_kv, head_dim, head_dim, type_k, type_v)
    k, v = randn(rng, n_kv, n_head_kv, head_dim), randn(rng, n_kv, n_head_kv, head_dim)
    q = randn(rng, n_tok, n_head, head_dim, scale=2.0)  # sharp enough softmax to notice a wrong mask
    kv_store(layer, np.arange(p0), k[:p0], v[:p0])  # history, then the batch's own rows
    positions = np.arange(p0, n_kv, dtype=np.int32)
    kv_store(layer, positions, k[p0:], v[p0:])
    layer.k[n_kv:] = 0xFF  # cells past the batch are garbage (NaN scales): a causal kernel never reads them
    layer.v[n_kv:] = 0xFF
    out = attention(q, layer, positions, 1.0 / np.sqrt(head_dim), n_swa=n_swa, softcap=softcap)
    assert out.shape == (n_tok, n_head, head_dim) and out.dtype == np.float32
    assert np.isfinite(out).all()
    return out, q, k, v, layer


ATTN_CASES = [  # (head_dim, n_head, n_head_kv, n_tok, p0): GQA 1/2/4, decode and prefill, odd sizes
    (64, 4, 4, 1, 0),
    (64, 4, 4, 1, 37),
    (128, 8, 4, 5, 0),
    (128, 8, 2, 1, 100),
    (256, 4, 1, 7, 13),
    (64, 6, 3, 9, 26),
]


@pytest.mark.parametrize("kv_type", KV_TYPES)
@pytest.mark.parametrize("case", ATTN_CASES)
def test_attention(kv_type, case):
    head_dim, n_head, n_head_kv, n_tok, p0 = case
    out, q, k, v, layer = run_case(kv_type, kv_type, head_dim, n_head, n_head_kv, n_tok, p0, seed=sum(case))
    positions = np.arange(p0, p0 + n_tok)
    scale = 1.0 / np.sqrt(head_dim)
    kd, vd = kv_read(layer, 0, p0 + n_tok)  # what the cache holds
    assert nmse(out, ref_attention(q, kd, vd, positions, scale)) < NMSE_EXACT
    assert nmse(out, ref_attention(q, k, v, positions, scale)) < LOOSE[kv_type]


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("n_swa,n_tok,p0", [(4, 6, 0), (5, 3, 20), (1, 2, 9), (64, 4, 10)])
def test_attention_sliding_window(kv_type, n_swa, n_tok, p0):
    out, q, k, v, layer = run_case(kv_type, kv_type, 64, 4, 2, n_tok, p0, n_swa=n_swa, seed=n_swa + p0)
    positions = np.arange(p0, p0 + n_tok)
    kd, vd = kv_read(layer, 0, p0 + n_tok)
    ref = ref_attention(q, kd, vd, positions, 0.125, n_swa=n_swa)
    assert nmse(out, ref) < NMSE_EXACT
    if n_swa < p0 + n_tok:  # the window really cut something: full attention differs
        assert nmse(out, ref_attention(q, kd, vd, positions, 0.125)) > 1e-4
    if n_swa == 1:  # each query sees only its own key: out = v of that key
        np.testing.assert_allclose(out, np.repeat(vd[positions], 2, axis=1), rtol=1e-6)


def test_attention_window_ignores_old_cells():
    _, q, _, _, layer = run_case("q4_0", "q4_0", 64, 2, 1, 2, 30, n_swa=8, seed=4)
    positions = np.arange(30, 32, dtype=np.int32)
    before = attention(q, layer, positions, 0.125, n_swa=8)
    layer.k[:23] = 0xFF  # cells outside every query's window: NaN scales
    layer.v[:23] = 0xFF
    np.testing.assert_array_equal(attention(q, layer, positions, 0.125, n_swa=8), before)


@pytest.mark.parametrize("kv_type", ["f32", "q8_0"])
def test_attention_softcap(kv_type):
    out, q, k, v, layer = run_case(kv_type, kv_type, 128, 4, 2, 3, 20, softcap=5.0, seed=9)
    kd, vd = kv_read(layer, 0, 23)
    assert nmse(out, ref_attention(q, kd, vd, np.arange(20, 23), 1 / np.sqrt(128), softcap=5.0)) < NMSE_EXACT


@pytest.mark.parametrize("type_k,type_v", [("q8_0", "f16"), ("f16", "q4_0"), ("q4_0", "f32")])
def test_attention_mixed_types(type_k, type_v):
    out, q, k, v, layer = run_case(type_k, type_v, 128, 4, 4, 4, 11, seed=5)
    kd, vd = kv_read(layer, 0, 15)
    assert nmse(out, ref_attention(q, kd, vd, np.arange(11, 15), 1 / np.sqrt(128))) < NMSE_EXACT


def test_attention_head_dim_v_differs_and_scattered_positions():
    rng = np.random.default_rng(6)
    layer = alloc_kv_layer(20, 2, 64, 32, "f32", "f16")
    k, v = randn(rng, 20, 2, 64), randn(rng, 20, 2, 32)
    kv_store(layer, np.arange(20), k, v)
    q = randn(rng, 3, 4, 64)
    positions = np.array([19, 0, 8], dtype=np.int32)  # any order: each query sees cells <= its position
    out = attention(q, layer, positions, 0.3)
    assert out.shape == (3, 4, 32) and np.isfinite(out).all()
    kd, vd = kv_read(layer, 0, 20)
    assert nmse(out, ref_attention(q, kd, vd, positions, 0.3)) < NMSE_EXACT
    np.testing.assert_allclose(out[1], np.repeat(vd[0], 2, axis=0), rtol=1e-6)  # position 0 sees one key


@pytest.mark.parametrize("hpi", [1, 2, 4])
def test_attention_heads_per_work_item(monkeypatch, hpi):
    # a work item handles hpi query heads of one GQA group (chosen from the thread count): all splits agree
    out, q, k, v, layer = run_case("q8_0", "q8_0", 64, 8, 2, 3, 5, seed=12)
    monkeypatch.setattr(attention_module, "_heads_per_item", lambda *args: hpi)
    np.testing.assert_allclose(attention(q, layer, np.arange(5, 8), 0.125), out, rtol=1e-6, atol=1e-7)


def test_attention_checks():
    layer = alloc_kv_layer(8, 2, 64)
    q = np.zeros((1, 3, 64), np.float32)
    with pytest.raises(ValueError, match="multiple of n_head_kv"):
        attention(q, layer, np.array([0]), 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        attention(np.zeros((1, 2, 32), np.float32), layer, np.array([0]), 1.0)
    with pytest.raises(ValueError, match="n_kv"):
        attention(np.zeros((1, 2, 64), np.float32), layer, np.array([8]), 1.0)
