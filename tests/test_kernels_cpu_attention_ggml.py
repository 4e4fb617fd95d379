"""attention_ggml (llama.cpp CPU flash-attention arithmetic) vs a slow numpy emulation of the same per-key algorithm,
and loosely vs float64 attention."""

from __future__ import annotations

import ctypes
import ctypes.util

import gguf
import gguf.quants
import numpy as np
import pytest

from kernels_cpu.attention import attention
from kernels_cpu.attention_ggml import attention_ggml, quantize_q8_0_x86, round_f16
from kernels_cpu.kv_cache import F16_TO_F32, alloc_kv_layer, kv_read, kv_store

# named tolerances (normalized mean squared error of the attention output)
NMSE_EMULATION = 1e-12  # vs the numpy emulation (it rounds an FMA through float64: a rare 1-ulp difference)
MIN_EXACT_FRACTION = 0.99  # ... and nearly every output element is bit-identical
NMSE_VS_CACHE = {  # vs float64 attention over the values the cache holds (Q rounded / quantized, fp16 accumulator)
    "f32": 1e-10, "f16": 1e-5, "q8_0": 2e-4, "q4_0": 2e-4}
NMSE_VS_F32 = {"f32": 1e-10, "f16": 1e-5, "q8_0": 1e-3, "q4_0": 1e-1}  # vs float64 attention over unquantized K/V
KV_TYPES = ["f16", "q8_0", "q4_0", "f32"]
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}

_libm = ctypes.CDLL(ctypes.util.find_library("m"))
for _name in ("expf", "tanhf"):  # ggml calls these scalar libm functions; numpy's float32 exp/tanh round differently
    getattr(_libm, _name).restype = ctypes.c_float
    getattr(_libm, _name).argtypes = [ctypes.c_float]
F32 = np.float32


def expf(x):
    return F32(_libm.expf(float(x)))


def fma32(a, b, c):
    # float32 fused multiply-add through float64 (exact product; the sum rounds twice, rarely differing by an ulp)
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def r16(x):
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def nmse(a, ref) -> float:
    a, ref = np.asarray(a, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.sum((a - ref) ** 2) / max(np.sum(ref ** 2), 1e-300))


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------- numpy emulation of ggml's arithmetic

def ref_quantize_q8_0_x86(x):
    """x f32 (n,) -> (qs int (n,), d f32 (n/32,)): x86 quantize_row_q8_0 (id = 127/amax, round half to even)."""
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1)
    d = r16(amax / F32(127))
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(np.float32)
    return np.rint(xb * idv[:, None]).astype(np.int64).reshape(-1), d


def reduce_f32x8(acc):
    # GGML_F32x8_REDUCE: 4 registers x 8 lanes -> (x0 + x2) + (x1 + x3) -> 128-bit halves -> two hadds
    a = acc.reshape(4, 8)
    r = (a[0] + a[2]) + (a[1] + a[3])
    t = r[:4] + r[4:]
    return (t[0] + t[1]) + (t[2] + t[3])


def ref_dot_float(k, q, double_sum):
    # ggml_vec_dot_f16 (double_sum: leftovers in double) / ggml_vec_dot_f32 on AVX2: 32 lanes fed by FMA
    n = q.shape[0]
    npart = n - n % 32
    acc = np.zeros(32, dtype=np.float32)
    for base in range(0, npart, 32):
        acc = fma32(k[base:base + 32], q[base:base + 32], acc)
    s = reduce_f32x8(acc)
    if double_sum:
        return F32(np.float64(s) + np.sum((k[npart:] * q[npart:]).astype(np.float64)))
    for i in range(npart, n):
        s = fma32(k[i], q[i], s)
    return F32(s)


def ref_dot_q8(kq, kd, qq, qd):
    # ggml_vec_dot_q{8,4}_0_q8_0 on AVX2: lane l = integer sum of elements 4l..4l+3 of a block, fma'd by d_k*d_q
    acc = np.zeros(8, dtype=np.float32)
    for b in range(kd.shape[0]):
        lanes = (kq[b * 32:(b + 1) * 32] * qq[b * 32:(b + 1) * 32]).reshape(8, 4).sum(axis=1).astype(np.float32)
        acc = fma32(F32(kd[b] * qd[b]), lanes, acc)
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))


def cache_contents(x, kv_type):
    """What ggml reads from a cache row, per cell and head: (float values, int values, block scales)."""
    if kv_type == "f32":
        return x, None, None
    if kv_type == "f16":
        return r16(x), None, None
    blocks = gguf.quants.quantize(x, GGML[kv_type])  # bit-exact with kv_store
    n_blocks = x.shape[-1] // 32
    blocks = blocks.reshape(*x.shape[:-1], n_blocks, -1)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kv_type == "q8_0":
        ints = blocks[..., 2:].view(np.int8).astype(np.int64)
    else:  # low nibbles are elements 0..15, high nibbles 16..31
        ints = np.concatenate([blocks[..., 2:] & 0xF, blocks[..., 2:] >> 4], axis=-1).astype(np.int64) - 8
    ints = ints.reshape(x.shape)
    return (ints.reshape(*x.shape[:-1], n_blocks, 32) * d[..., None]).astype(np.float32).reshape(x.shape), ints, d


def ref_attention_ggml(q, k, v, type_k, type_v, positions, scale, n_swa=0, softcap=0.0):
    """The per-key online softmax of ggml_compute_forward_flash_attn_ext_f16_one_chunk, with numpy float32/float16
    scalars. q (n_tok, n_head, dk), k/v (n_kv, n_head_kv, d) unquantized f32 -> (n_tok, n_head, dv) f32."""
    kf, kint, kd = cache_contents(k, type_k)
    vf, _, _ = cache_contents(v, type_v)
    n_tok, n_head, _ = q.shape
    group = n_head // k.shape[1]
    out = np.zeros((n_tok, n_head, v.shape[2]), dtype=np.float32)
    scale = F32(scale)
    if softcap:
        scale = F32(scale / F32(softcap))
    for t, p in enumerate(positions):
        for h in range(n_head):
            hk = h // group
            if type_k == "f16":
                qh = r16(q[t, h])
            elif type_k != "f32":
                qq, qd = ref_quantize_q8_0_x86(q[t, h])
            m, s_sum = F32(-np.inf), F32(0.0)
            vkq = np.zeros(v.shape[2], dtype=np.float32)
            for c in range(max(0, p - n_swa + 1) if n_swa > 0 else 0, p + 1):
                if type_k == "f16":
                    s = ref_dot_float(kf[c, hk], qh, double_sum=True)
                elif type_k == "f32":
                    s = ref_dot_float(kf[c, hk], q[t, h], double_sum=False)
                else:
                    s = ref_dot_q8(kint[c, hk], kd[c, hk], qq, qd)
                s = F32(s * scale)
                if softcap:
                    s = F32(F32(softcap) * F32(_libm.tanhf(float(s))))
                ms, vs = F32(1.0), F32(1.0)
                if s > m:
                    m_old, m = m, s
                    ms = expf(m_old - m)
                    vkq = r16(vkq * ms) if type_v == "f16" else (vkq * ms).astype(np.float32)
                else:
                    vs = expf(F32(s - m))
                vkq = fma32(vf[c, hk], vs, vkq)
                if type_v == "f16":
                    vkq = r16(vkq)  # VKQ16: back to fp16 after every multiply-add
                s_sum = fma32(s_sum, ms, vs)
            out[t, h] = vkq * (F32(0.0) if s_sum == 0 else F32(1.0) / s_sum)
    return out


def ref_attention_f64(q, k, v, positions, scale, n_swa=0, softcap=0.0):
    """float64: q (n_tok, n_head, dk), k (n_kv, n_head_kv, dk), v (n_kv, n_head_kv, dv) -> (n_tok, n_head, dv)."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kh, vh = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    keys = np.arange(k.shape[0])
    for t, p in enumerate(positions):
        visible = (keys <= p) & ((p - keys < n_swa) if n_swa > 0 else True)
        s = np.einsum("hd,khd->hk", q[t], kh[visible]) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[t] = np.einsum("hk,khd->hd", w / w.sum(axis=1, keepdims=True), vh[visible])
    return out


# ---------------------------------------------------------------- helpers

def test_round_f16_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1 << 32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, 65504.0, 65519.99, 65520.0, 1e9, 6.1035156e-05, 6.1035152e-05, 2.9802322e-08, 1e-30,
                      1.00048828125, 1.00146484375, np.inf], dtype=np.float32)
    x = np.concatenate([x[np.isfinite(x)], edges, -edges, randn(rng, 10_000, scale=1e-5)])
    ours = np.array([round_f16(v, F16_TO_F32) for v in x], dtype=np.float32)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(ours.view(np.uint32), r16(x).view(np.uint32))  # bitwise: signs of zeros too


def test_quantize_q8_0_x86():
    rng = np.random.default_rng(1)
    x = randn(rng, 8 * 32, scale=3.0)
    x[:32] = 0.0  # an all-zero block
    x[32:64] = np.arange(32) - 15.5  # halves, amax 15.5
    x[64:96] = 0.5 * (np.arange(32) - 16)  # amax 8: id = 127/8 exact, x * id hits n + 0.5 exactly
    x[96] = 127.0
    x[97:128] = 2.5  # amax 127: id = 1, 2.5 -> 2 (half to even, where the _ref's roundf gives 3)
    qq, qd = np.empty(256, np.int8), np.empty(8, np.float32)
    quantize_q8_0_x86(x, qq, qd, F16_TO_F32)
    want_q, want_d = ref_quantize_q8_0_x86(x)
    np.testing.assert_array_equal(qq, want_q)
    np.testing.assert_array_equal(qd, want_d)
    assert qq[97] == 2 and not qq[:32].any()


# ---------------------------------------------------------------- attention

def run_case(type_k, type_v, head_dim, n_head, n_head_kv, n_tok, p0, n_swa=0, softcap=0.0, seed=0, head_dim_v=None):
    """Cells [0, p0 + n_tok) filled with random K/V, batch at positions p0..: checked against the emulation."""
    rng = np.random.default_rng(seed)
    dv = head_dim_v or head_dim
    n_kv = p0 + n_tok
    layer = alloc_kv_layer(n_kv + 3, n_head_kv, head_dim, dv, type_k, type_v)
    k, v = randn(rng, n_kv, n_head_kv, head_dim), randn(rng, n_kv, n_head_kv, dv)
    q = randn(rng, n_tok, n_head, head_dim, scale=2.0)  # sharp softmax: a wrong mask shows
    positions = np.arange(p0, n_kv, dtype=np.int32)
    kv_store(layer, np.arange(p0), k[:p0], v[:p0])
    kv_store(layer, positions, k[p0:], v[p0:])
    layer.k[n_kv:] = 0xFF  # garbage past the batch (NaN scales): never read
    layer.v[n_kv:] = 0xFF
    scale = 1.0 / np.sqrt(head_dim)
    out = attention_ggml(q, layer, positions, scale, n_swa=n_swa, softcap=softcap)
    assert out.shape == (n_tok, n_head, dv) and out.dtype == np.float32
    assert np.isfinite(out).all()
    ref = ref_attention_ggml(q, k, v, type_k, type_v, positions, scale, n_swa, softcap)
    assert nmse(out, ref) < NMSE_EMULATION
    assert np.mean(out == ref) >= MIN_EXACT_FRACTION
    return out, q, k, v, layer, positions, scale


GQA = [(4, 4), (4, 2), (8, 2)]  # (n_head, n_head_kv): groups of 1, 2, 4


@pytest.mark.parametrize("kv_type", KV_TYPES)
@pytest.mark.parametrize("n_head,n_head_kv", GQA)
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("n_tok,p0", [(1, 23), (5, 9)])
def test_attention_ggml(kv_type, n_head, n_head_kv, head_dim, n_tok, p0):
    out, q, k, v, layer, positions, scale = run_case(kv_type, kv_type, head_dim, n_head, n_head_kv, n_tok, p0,
                                                     seed=head_dim + n_head + n_head_kv + n_tok)
    kd, vd = kv_read(layer, 0, p0 + n_tok)
    assert nmse(out, ref_attention_f64(q, kd, vd, positions, scale)) < NMSE_VS_CACHE[kv_type]
    assert nmse(out, ref_attention_f64(q, k, v, positions, scale)) < NMSE_VS_F32[kv_type]


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("n_swa,n_tok,p0", [(4, 6, 0), (5, 3, 20), (1, 2, 9)])
def test_attention_ggml_sliding_window(kv_type, n_swa, n_tok, p0):
    out, q, k, v, layer, positions, scale = run_case(kv_type, kv_type, 64, 4, 2, n_tok, p0, n_swa=n_swa,
                                                     seed=n_swa + p0)
    kd, vd = kv_read(layer, 0, p0 + n_tok)
    assert nmse(out, ref_attention_f64(q, kd, vd, positions, scale, n_swa=n_swa)) < NMSE_VS_CACHE[kv_type]
    assert nmse(out, ref_attention_f64(q, kd, vd, positions, scale)) > 1e-4  # the window cut something
    layer.k[:max(0, p0 - n_swa + 1)] = 0xFF  # cells outside every window: NaN scales / values, never read
    layer.v[:max(0, p0 - n_swa + 1)] = 0xFF
    np.testing.assert_array_equal(attention_ggml(q, layer, positions, scale, n_swa=n_swa), out)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_attention_ggml_softcap(kv_type):
    out, q, k, v, layer, positions, scale = run_case(kv_type, kv_type, 128, 4, 2, 3, 20, softcap=5.0, seed=9)
    kd, vd = kv_read(layer, 0, 23)
    assert nmse(out, ref_attention_f64(q, kd, vd, positions, scale, softcap=5.0)) < NMSE_VS_CACHE[kv_type]


@pytest.mark.parametrize("type_k,type_v,head_dim,head_dim_v", [
    ("q8_0", "f16", 128, 128), ("f16", "q4_0", 64, 96), ("q4_0", "f32", 128, 64),
    ("f16", "f16", 80, 48), ("f32", "f16", 72, 40),  # head_dim % 32 != 0: the dot products' scalar leftovers
])
def test_attention_ggml_mixed_types_and_dims(type_k, type_v, head_dim, head_dim_v):
    out, q, k, v, layer, positions, scale = run_case(type_k, type_v, head_dim, 4, 2, 4, 11, seed=5,
                                                     head_dim_v=head_dim_v)
    kd, vd = kv_read(layer, 0, 15)
    assert nmse(out, ref_attention_f64(q, kd, vd, positions, scale)) < max(NMSE_VS_CACHE[type_k],
                                                                           NMSE_VS_CACHE[type_v])


def test_attention_ggml_tracks_plain_kernel_and_scattered_positions():
    rng = np.random.default_rng(6)
    layer = alloc_kv_layer(20, 2, 64, 64, "f16", "f16")
    kv_store(layer, np.arange(20), randn(rng, 20, 2, 64), randn(rng, 20, 2, 64))
    q = randn(rng, 3, 4, 64)
    positions = np.array([19, 0, 8], dtype=np.int32)  # any order: each query sees cells <= its position
    out = attention_ggml(q, layer, positions, 0.3)
    plain = attention(q, layer, positions, 0.3)
    assert 0 < nmse(out, plain) < NMSE_VS_CACHE["f16"]  # fp16 Q and accumulator: close, not identical
    _, vd = kv_read(layer, 0, 1)
    np.testing.assert_array_equal(out[1], np.repeat(vd[0], 2, axis=0))  # one key: fp16(v * 1) * (1/1) = v
    assert not attention_ggml(q[:1], layer, positions[:1], 0.3, n_kv=0).any()  # nothing visible: S = 0 -> zeros


def test_attention_ggml_checks():
    layer = alloc_kv_layer(8, 2, 64)
    with pytest.raises(ValueError, match="multiple of n_head_kv"):
        attention_ggml(np.zeros((1, 3, 64), np.float32), layer, np.array([0]), 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        attention_ggml(np.zeros((1, 2, 32), np.float32), layer, np.array([0]), 1.0)
    with pytest.raises(ValueError, match="n_kv"):
        attention_ggml(np.zeros((1, 2, 64), np.float32), layer, np.array([8]), 1.0)
    with pytest.raises(ValueError, match="float32"):
        attention_ggml(np.zeros((1, 2, 64)), layer, np.array([0]), 1.0)
