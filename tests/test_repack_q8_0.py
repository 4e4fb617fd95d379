"""Q8_0 rows interleaved by 8 (kernels_cpu.q8_0_x8): the layout against its docstring (a numpy inverse gives the
file's bytes back), matmul against float64 references and the plain Q8_0 kernels, the VNNI and the generic (AVX2)
sums alike, rows decoded and looked up (get_rows) as gguf's dequantize bit for bit, and the loader: a tied output
repacked once for the embedding lookup and the output matrix, the logits unchanged against --no-repack."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from numba import njit

from hybrid.backends.repack import LAYOUTS
from hybrid.engine import Engine, EngineParams
from hybrid.tools.synth.model import make_model
from kernels_cpu import act_quant, get_rows, q8_0_x8, simd, vec_dot_legacy
from kernels_cpu.matmul import GEMM_MIN_TOKENS_AVX2, NEVER, REPACKED, matmul
from test_kernels_cpu_matmul import NMSE_TOL_SAME_ACT, converted_activations, dequantize64, nmse, random_weight

# (n_out, n_blocks, n_tok): one group, groups not filling a 16-row block, a few tokens, a batch through the GEMM at
# the crossover of hosts without VNNI (passed, so that every host runs both paths) and through the integer dots
CASES = [(8, 1, 1), (24, 3, 1), (40, 2, 4), (136, 2, 5), (64, 4, GEMM_MIN_TOKENS_AVX2 + 3)]
CROSSOVERS = {"gemm_from_64": GEMM_MIN_TOKENS_AVX2, "int_dots": NEVER}


def _unrepack(rp: np.ndarray) -> np.ndarray:
    """The file's Q8_0 rows from the layout as q8_0_x8's docstring draws it (d[8] fp16, qs[chunk][row][4] ^ 0x80)."""
    n_out, rb = rp.shape
    nb = rb // 34
    blocks = rp.reshape(n_out // 8, nb, 272)
    d = blocks[:, :, :16].reshape(n_out // 8, nb, 8, 2)
    qs = (blocks[:, :, 16:] ^ 0x80).reshape(n_out // 8, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4)  # (g, b, row, j, e)
    rows = np.concatenate([d, qs.reshape(n_out // 8, nb, 8, 32)], axis=3)  # (g, b, row, 34)
    return np.ascontiguousarray(rows.transpose(0, 2, 1, 3)).reshape(n_out, rb)


def test_layout_round_trip_and_guards():
    rng = np.random.default_rng(1)
    w = random_weight("Q8_0", 24, 96, rng)
    rp = q8_0_x8.repack(w)
    assert rp.shape == w.shape and REPACKED["Q8_0_X8"].row_group == 8 and LAYOUTS["Q8_0"][0] == "Q8_0_X8"
    assert np.array_equal(_unrepack(rp), w)
    assert not q8_0_x8.repackable((12, 64)) and q8_0_x8.repackable((16, 64))
    with pytest.raises(ValueError, match="8-row groups"):
        q8_0_x8.repack(random_weight("Q8_0", 12, 64, rng))
    with pytest.raises(ValueError, match="groups of 8 rows"):
        matmul(np.zeros((4, 34), dtype=np.uint8), "Q8_0_X8", np.zeros(32, dtype=np.float32))


@pytest.mark.parametrize("gemm_from", CROSSOVERS.values(), ids=CROSSOVERS.keys())
@pytest.mark.parametrize("n_out, nb, n_tok", CASES)
def test_matmul_matches_float64_and_plain(n_out, nb, n_tok, gemm_from):
    rng = np.random.default_rng(n_out + nb)
    w = random_weight("Q8_0", n_out, 32 * nb, rng)
    x = rng.standard_normal((n_tok, 32 * nb)).astype(np.float32)
    x[0, :16] *= 40.0  # activation codes at +-127
    y = matmul(q8_0_x8.repack(w), "Q8_0_X8", x, gemm_from=gemm_from)
    ref = converted_activations(x, "Q8_0") @ dequantize64(w, "Q8_0").T
    assert np.isfinite(y).all() and nmse(y, ref) < NMSE_TOL_SAME_ACT
    plain = matmul(w, "Q8_0", x, gemm_from=gemm_from)
    if n_tok >= gemm_from:  # rows decoded to the same floats, the same GEMM
        assert np.array_equal(y, plain)
    else:  # the same exact integer sums per block, summed in another float order
        assert np.allclose(y, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())


def test_extreme_codes_are_exact():
    """Weight codes -128 and 127 (q ^ 0x80 = 0 and 255) against activation codes +-127: the int32 sums of a block are
    exact, so each output is sum_b float32(sum q q8) * (d_w d_x) in float32, within float32 rounding of float64."""
    rng = np.random.default_rng(2)
    w = random_weight("Q8_0", 16, 64, rng).reshape(16, 2, 34)
    w[:8, :, 2:] = 0x80  # -128
    w[8:, :, 2:] = 0x7F  # 127
    w = w.reshape(16, 68)
    x = np.where(rng.random((4, 64)) < 0.5, -1.0, 1.0).astype(np.float32)
    y = matmul(q8_0_x8.repack(w), "Q8_0_X8", x)
    ref = converted_activations(x, "Q8_0") @ dequantize64(w, "Q8_0").T
    assert np.allclose(y, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_generic_sums_equal_vnni_sums():
    """The path of a host without VNNI (FORCE_GENERIC: signed codes through |q| and sign(q8)) gives the host's
    floats bit for bit: both sum each block exactly, then do the same float work."""
    rng = np.random.default_rng(4)
    nb, n_out = 3, 16
    rp = q8_0_x8.repack(random_weight("Q8_0", n_out, 32 * nb, rng))
    flat = rp.reshape(-1)
    flat.flags.writeable = False
    x = rng.standard_normal((4, 32 * nb)).astype(np.float32)
    qs, d, _ = act_quant.quantize_q8_1(x)
    ys = []
    for generic in (False, True):
        simd.FORCE_GENERIC[0] = generic
        try:
            fn = njit(q8_0_x8.dot8x4_q8_0_x8.py_func, fastmath=True)
            y = np.zeros(4 * n_out, dtype=np.float32)
            for g in range(0, n_out, 8):
                fn(flat, g * rp.shape[1], qs.reshape(-1), d.reshape(-1), 0, 1, 2, 3, nb, y, n_out, g)
        finally:
            simd.FORCE_GENERIC[0] = False
        ys.append(y)
    assert np.array_equal(ys[0], ys[1])


def test_rows_decode_and_look_up_as_ggml():
    rng = np.random.default_rng(3)
    nb = 20
    w = random_weight("Q8_0", 32, 32 * nb, rng)
    rp = q8_0_x8.repack(w)
    flat = rp.reshape(-1)
    ref = gguf_dequantize(w, GGMLQuantizationType.Q8_0).astype(np.float32)
    out = np.empty(32 * nb, dtype=np.float32)
    for r in range(32):
        vec_dot_legacy.decode_row_f32(vec_dot_legacy.Q8_0_X8, flat, r * rp.shape[1], nb, out, 0)
        assert np.array_equal(out, ref[r])
    ids = np.array([3, 0, 31, 3, 17, 8], dtype=np.int64)
    np.testing.assert_array_equal(get_rows.get_rows(rp, "Q8_0_X8", ids), ref[ids])


def test_tied_output_is_repacked_once_and_the_logits_agree(tmp_path):
    path = tmp_path / "gemma3-q8_0.gguf"
    make_model(path, "gemma3", "tiny", "Q8_0", seed=7, n_layer=2)  # token_embd Q8_0, tied
    notes: list[str] = []
    a = Engine.load(path, EngineParams(n_ctx=64), progress=notes.append)
    b = Engine.load(path, EngineParams(n_ctx=64, repack=False))
    assert b.weights.output is b.weights.token_embd and b.weights.token_embd.type_name == "Q8_0"
    assert a.weights.output is a.weights.token_embd and a.weights.token_embd.type_name == "Q8_0_X8"  # one copy
    assert np.array_equal(a.weights.token_embd.raw, q8_0_x8.repack(np.asarray(b.weights.token_embd.raw)))
    assert any("Q8_0" in n and n.startswith("repack:") for n in notes)
    ids = np.array([5, 0, 1023, 77], dtype=np.int64)  # the embedding rows, from the layout, are the file's
    np.testing.assert_array_equal(a.cpu.get_rows(a.weights.token_embd, ids), b.cpu.get_rows(b.weights.token_embd, ids))
    ca, cb = a.new_cache(), b.new_cache()
    for tokens in ([3, 4, 5, 6, 7, 8], [9], [10]):
        la, lb = np.asarray(a.eval(tokens, ca))[-1], np.asarray(b.eval(tokens, cb))[-1]
        assert la.argmax() == lb.argmax() and np.abs(la - lb).max() < 1e-3 * np.abs(lb).max()
