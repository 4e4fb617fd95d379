"""MXFP4 and IQ4_XS rows interleaved by 8 (kernels_cpu.mxfp4_x8, kernels_cpu.iq4_xs_x8): each repacked matmul
against float64 references and against the plain kernels, the rows unpacked to the file's exact bytes and decoded
as ggml's dequantize, MXFP4's smallest E8M0 scales, a fused triple with other types, the guards, and the loader's
repack with the model's outputs unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import hybrid.backends.repack as repack_mod
from hybrid.engine import Engine, EngineParams
from hybrid.tools.synth.model import make_model
from kernels_cpu import iq4_xs_x8, mxfp4_x8, vec_dot_k, vec_dot_legacy
from kernels_cpu.matmul import GEMM_MIN_TOKENS_AVX2, KERNELS, NEVER, REPACKED, matmul, matmuls
from test_kernels_cpu_matmul import NMSE_TOL_SAME_ACT, converted_activations, dequantize64, random_weight

# type -> (layout, block, module, kind code of the layout, its family's decoder)
TYPES = {"MXFP4": ("MXFP4_X8", 32, mxfp4_x8, vec_dot_legacy.MXFP4_X8, vec_dot_legacy.decode_row_f32),
         "IQ4_XS": ("IQ4_XS_X8", 256, iq4_xs_x8, vec_dot_k.IQ4_XS_X8, vec_dot_k.decode_row_f32)}
# (n_out, n_blocks, n_tok): one group, groups not filling a 16-row block, a few tokens, a batch through the GEMM at
# the crossover of hosts without VNNI (passed, so that every host runs both paths) and through the integer dots
CASES = [(8, 1, 1), (24, 3, 1), (136, 2, 5), (64, 4, GEMM_MIN_TOKENS_AVX2 + 3)]
CROSSOVERS = {"gemm_from_64": GEMM_MIN_TOKENS_AVX2, "int_dots": NEVER}


def nmse(a, ref):
    return float(np.mean((np.asarray(a, np.float64) - ref) ** 2) / max(np.mean(ref ** 2), 1e-30))


def _check(w, name, x, gemm_from=None):
    layout, _, mod, _, _ = TYPES[name]
    rp = mod.repack(w)
    assert rp.shape == (w.shape[0], w.shape[1] // KERNELS[name].type_size * REPACKED[layout].type_size)
    y = matmul(rp, layout, x, gemm_from=gemm_from)
    ref = converted_activations(x, name) @ dequantize64(w, name).T
    assert np.isfinite(y).all() and nmse(y, ref) < NMSE_TOL_SAME_ACT
    plain = matmul(w, name, x, gemm_from=gemm_from)
    if gemm_from is not None and x.shape[0] >= gemm_from:  # rows decoded to the same floats, the same GEMM
        assert np.array_equal(y, plain)
    else:  # the same exact integer sums per block, summed in another float order
        assert np.allclose(y, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())


@pytest.mark.parametrize("gemm_from", CROSSOVERS.values(), ids=CROSSOVERS.keys())
@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("n_out, nb, n_tok", CASES)
def test_x8_matmul_matches_float64_and_plain(name, n_out, nb, n_tok, gemm_from):
    block = TYPES[name][1]
    rng = np.random.default_rng(n_out + nb)
    _check(random_weight(name, n_out, block * nb, rng), name,
           rng.standard_normal((n_tok, block * nb)).astype(np.float32), gemm_from)


@pytest.mark.parametrize("name", list(TYPES))
def test_x8_rows_unpack_to_the_file_bytes_and_decode_as_ggml(name):
    layout, block, mod, kind, decode = TYPES[name]
    rng = np.random.default_rng(3)
    nb = 2 if block == 256 else 16
    w = random_weight(name, 16, block * nb, rng)
    rp = mod.repack(w)
    rb, flat = rp.shape[1], rp.reshape(-1)
    ref = dequantize64(w, name)
    row = np.empty(w.shape[1], dtype=np.uint8)
    out = np.empty(block * nb, dtype=np.float32)
    for r in range(16):
        mod.unpack_row(flat, r * rb, nb, row)
        assert np.array_equal(row, w[r])
        decode(kind, flat, r * rb, nb, out, 0)
        assert np.array_equal(out, ref[r].astype(np.float32))


def test_mxfp4_x8_smallest_and_largest_scales():
    """E8M0 0 and 1 are subnormal halves (ggml_e8m0_to_fp32_half's special case); 254 the largest used."""
    rng = np.random.default_rng(6)
    w = random_weight("MXFP4", 16, 64, rng).reshape(16, 2, 17)
    w[:, :, 0] = rng.choice([0, 1, 2, 3, 127, 130], (16, 2))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    _check(w.reshape(16, 34), "MXFP4", x)
    big = w.copy()
    big[:, :, 0] = 140
    _check(big.reshape(16, 34), "MXFP4", x)


@pytest.mark.parametrize("name, other", [("MXFP4", "Q8_0"), ("IQ4_XS", "Q6_K")])
def test_x8_in_a_fused_triple_with_other_types(name, other):
    layout, block, mod, _, _ = TYPES[name]
    rng = np.random.default_rng(4)
    w, o = random_weight(name, 32, 512, rng), random_weight(other, 16, 512, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    ys = matmuls([(mod.repack(w), layout), (o, other), (w, name)], x)
    assert np.array_equal(ys[1], matmul(o, other, x))
    assert np.allclose(ys[0], ys[2], rtol=1e-5, atol=1e-5 * np.abs(ys[2]).max())


def test_x8_guards():
    rng = np.random.default_rng(5)
    assert not mxfp4_x8.repackable((12, 64)) and mxfp4_x8.repackable((16, 64))
    assert not iq4_xs_x8.repackable((12, 256)) and iq4_xs_x8.repackable((16, 512))
    with pytest.raises(ValueError, match="8-row groups"):
        mxfp4_x8.repack(random_weight("MXFP4", 12, 64, rng))
    with pytest.raises(ValueError, match="8-row groups"):
        iq4_xs_x8.repack(random_weight("IQ4_XS", 12, 256, rng))
    with pytest.raises(ValueError, match="groups of 8 rows"):
        matmul(np.zeros((12, 138), dtype=np.uint8), "IQ4_XS_X8", np.zeros(256, dtype=np.float32))


@pytest.mark.parametrize("mix", ["MXFP4", "IQ4_XS"])
def test_loader_repacks_and_results_agree(tmp_path, monkeypatch, mix):
    # the layouts are made where the compile list names their repack (kernels_cpu.signatures.REPACK): named here
    monkeypatch.setattr(repack_mod, "_COMPILED_REPACKS", {**repack_mod._COMPILED_REPACKS, mix: ""})
    path = tmp_path / f"{mix}.gguf"
    make_model(path, "llama", "tiny", mix, seed=7, n_layer=2)
    a = Engine.load(path, EngineParams(n_ctx=64))
    b = Engine.load(path, EngineParams(n_ctx=64, repack=False))
    layout, _, mod, _, _ = TYPES[mix]
    repacked = [k for k, w in a.weights.layers[0].items() if w.type_name == layout]
    assert {"attn_q", "ffn_gate", "ffn_down"} <= set(repacked)
    for k in repacked:
        assert np.array_equal(a.weights.layers[0][k].raw, mod.repack(np.asarray(b.weights.layers[0][k].raw)))
    ca, cb = a.new_cache(), b.new_cache()
    for tokens in (list(range(3, 15)), [7], [9]):
        la, lb = np.asarray(a.eval(tokens, ca))[-1], np.asarray(b.eval(tokens, cb))[-1]
        assert np.isfinite(la).all()
        # the tiny random IQ4_XS model amplifies float-order differences (its Q8_K activation roundings flip: 1e-6
        # relative noise on its products moves the logits by 1-10%), so only MXFP4's logits are compared
        if mix == "MXFP4":
            assert la.argmax() == lb.argmax()
            assert np.abs(la - lb).max() < 1e-3 * np.abs(lb).max()


@pytest.mark.parametrize("name", list(TYPES))
def test_x8_dots_on_the_generic_path(name):
    """The dot of each layout compiled afresh with FORCE_GENERIC (no AVX2, no VNNI: the |v| / sign(q8) or
    vpmaddubsw path a host without VNNI runs, in portable IR) gives the host's floats (the same exact integer sums,
    then the same float work)."""
    from numba import njit

    from kernels_cpu import simd

    _, block, mod, _, _ = TYPES[name]
    host = mod.dot8_mxfp4_x8 if name == "MXFP4" else mod.dot8_iq4_xs_x8
    rng = np.random.default_rng(9)
    nb = 3
    w = mod.repack(random_weight(name, 16, block * nb, rng))
    xq = rng.integers(-127, 128, block * nb).astype(np.int8)
    xd = rng.uniform(0.01, 0.1, nb * block // 32).astype(np.float32)
    flat = w.reshape(-1)
    flat.flags.writeable = False
    simd.FORCE_GENERIC[0] = True
    try:
        generic = njit(host.py_func)
        y_gen = np.zeros(16, dtype=np.float32)
        for g in range(2):
            generic(flat, g * 8 * w.shape[1], xq, xd, nb, y_gen, 8 * g)
    finally:
        simd.FORCE_GENERIC[0] = False
    y_host = np.zeros(16, dtype=np.float32)
    for g in range(2):
        host(flat, g * 8 * w.shape[1], xq, xd, nb, y_host, 8 * g)
    assert np.isfinite(y_host).all() and np.array_equal(y_gen, y_host)


@pytest.mark.parametrize("generic", [False, True])
def test_dpbusd_sums_four_products_exactly(generic):
    from numba import njit

    from kernels_cpu import simd
    from kernels_cpu.simd_int import zero_i32
    from kernels_cpu.simd_x8 import dpbusd

    simd.FORCE_GENERIC[0] = generic
    try:
        @njit
        def run(u, s, out):  # two in a row: the second accumulates onto the first
            a = dpbusd(zero_i32(), simd.load_i8x32(u, 0), simd.load_i8x32(s, 0))
            simd.store_i32x8(out, 0, dpbusd(a, simd.load_i8x32(u, 32), simd.load_i8x32(s, 32)))
        rng = np.random.default_rng(2)
        u = np.array([255] * 16 + list(rng.integers(0, 256, 48)), dtype=np.uint8)
        s = np.array([-128] * 8 + [127] * 8 + list(rng.integers(-128, 128, 48)), dtype=np.int8)
        out = np.zeros(8, dtype=np.int32)
        run(u, s.view(np.uint8), out)
    finally:
        simd.FORCE_GENERIC[0] = False
    p = (u.astype(np.int64) * s.astype(np.int64)).reshape(2, 8, 4).sum(axis=(0, 2))
    assert np.array_equal(out, p)
