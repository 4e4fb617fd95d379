"""Small batches (2..63 tokens: below every host's crossover) through the multi-token integer dots (4 or 2 tokens a
pass over each weight block: vec_dot_legacy.dot2x4_q8_0, legacy_x8.dot8x4_q{4,5}_0_x8, q8_0_x8.dot8x4_q8_0_x8,
q4_k_x8.dot8x4_q4_k_x8, k_tokens.dot2x4_q6_k and their 2-token forms): every output equals the token's own 1-token
product bit for bit, on the host's path (VNNI here) and on the generic one (no AVX2 intrinsics, no VNNI: what a host
without VNNI runs), and stays within the float64 reference's tolerance."""

import numpy as np
import pytest
from numba import njit

from kernels_cpu import act_quant, legacy_x8, q4_k_x8, q8_0_x8, k_tokens, simd, vec_dot_k, vec_dot_legacy
from kernels_cpu.matmul import GEMM_MIN_TOKENS_AVX2, KERNELS, matmul, matmuls
from test_kernels_cpu_matmul import NMSE_TOL_SAME_ACT, converted_activations, dequantize64, nmse, random_weight

# layout as decode runs it -> (GGML type, repack or None)
TYPES = {"Q8_0": ("Q8_0", None), "Q4_0_X8": ("Q4_0", legacy_x8.repack_q4_0),
         "Q5_0_X8": ("Q5_0", legacy_x8.repack_q5_0), "Q8_0_X8": ("Q8_0", q8_0_x8.repack),
         "Q4_K_X8": ("Q4_K", q4_k_x8.repack), "Q6_K": ("Q6_K", None)}
# (n_out, blocks a row): one block; rows not a multiple of the 16-row blocks (plain layouts: an odd count, a lone
# last row), several tasks
SHAPES = {"Q8_0": [(1, 1), (37, 3), (301, 2)], "Q6_K": [(1, 1), (37, 2), (301, 1)],
          "Q4_0_X8": [(8, 1), (40, 3), (296, 2)], "Q5_0_X8": [(8, 1), (40, 3), (296, 2)],
          "Q8_0_X8": [(8, 1), (40, 3), (296, 2)],
          "Q4_K_X8": [(8, 1), (40, 2), (296, 1)]}
TOKENS = list(range(1, 17)) + [GEMM_MIN_TOKENS_AVX2 - 1]


def _weight(layout, n_out, nb, rng):
    base, repack = TYPES[layout]
    w = random_weight(base, n_out, nb * KERNELS[base].block_size, rng)
    return w, (repack(w) if repack else w)


def _x(n_tok, n_in, rng):
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[0, : n_in // 2] *= 40.0  # one token with a wide range (activation codes at +-127 / -128)
    return x


@pytest.mark.parametrize("layout", list(TYPES))
def test_batch_equals_each_token_alone_and_float64(layout):
    rng = np.random.default_rng(list(TYPES).index(layout))
    for n_out, nb in SHAPES[layout]:
        w_plain, w = _weight(layout, n_out, nb, rng)
        n_in = nb * KERNELS[TYPES[layout][0]].block_size
        w64 = dequantize64(w_plain, TYPES[layout][0])
        for n_tok in TOKENS:
            x = _x(n_tok, n_in, rng)
            y = matmul(w, layout, x)
            alone = np.stack([matmul(w, layout, x[t:t + 1])[0] for t in range(n_tok)])
            assert np.isfinite(y).all()
            assert np.array_equal(y, alone), (layout, n_out, nb, n_tok)
            ref = converted_activations(x, TYPES[layout][0]) @ w64.T
            if y.size > 1:
                assert nmse(y, ref) < NMSE_TOL_SAME_ACT, (layout, n_out, nb, n_tok)


@pytest.mark.parametrize("family", ["legacy", "k"])
def test_fused_weights_in_a_batch_equal_one_by_one(family):
    """matmuls (q/k/v, gate/up in one parallel pass) with multi-token and 1-token types side by side."""
    rng = np.random.default_rng(5)
    names = ["Q8_0", "Q5_0_X8", "Q4_0"] if family == "legacy" else ["Q4_K_X8", "Q6_K", "Q5_K"]
    block = 32 if family == "legacy" else 256
    ws = []
    for name in names:
        if name in TYPES:
            ws.append((_weight(name, 48, 2, rng)[1], name))
        else:
            ws.append((random_weight(name, 24, 2 * block, rng), name))
    for n_tok in (2, 3, 5, 6, 9):
        x = _x(n_tok, 2 * block, rng)
        for y, (w, name) in zip(matmuls(ws, x), ws):
            assert np.array_equal(y, np.stack([matmul(w, name, x[t:t + 1])[0] for t in range(n_tok)])), name


# -- the kernels themselves, host path and generic path ---------------------------------------------------------
def _legacy_act(x):
    qs, d, _ = act_quant.quantize_q8_1(x)
    return qs, d, None


def _k_act(x):
    return act_quant.quantize_q8_k(x)


# layout -> (1-token kernel call, 4-token kernel, 2-token kernel, rows a call, activations)
def _one_legacy_x8(fn):
    def run(w, go, rb, qs, d, bs, nb, y, r):
        fn(w, go, qs, d, nb, y, r)
    return run


def _one_plain(fn):
    def run(w, go, rb, qs, d, bs, nb, y, r):
        v0, v1 = fn(w, go, rb, qs, d, nb) if bs is None else fn(w, go, rb, qs, d, bs, nb)
        y[r] = v0
        if rb:
            y[r + 1] = v1
    return run


KERNEL_SETS = {
    "Q8_0": (_one_plain(vec_dot_legacy.dot2_q8_0), vec_dot_legacy.dot2x4_q8_0, vec_dot_legacy.dot2x2_q8_0, 2,
             _legacy_act),
    "Q4_0_X8": (_one_legacy_x8(legacy_x8.dot8_q4_0_x8), legacy_x8.dot8x4_q4_0_x8, legacy_x8.dot8x2_q4_0_x8, 8,
                _legacy_act),
    "Q5_0_X8": (_one_legacy_x8(legacy_x8.dot8_q5_0_x8), legacy_x8.dot8x4_q5_0_x8, legacy_x8.dot8x2_q5_0_x8, 8,
                _legacy_act),
    "Q8_0_X8": (_one_legacy_x8(q8_0_x8.dot8_q8_0_x8), q8_0_x8.dot8x4_q8_0_x8, q8_0_x8.dot8x2_q8_0_x8, 8,
                _legacy_act),
    "Q4_K_X8": (None, q4_k_x8.dot8x4_q4_k_x8, q4_k_x8.dot8x2_q4_k_x8, 8, _k_act),
    "Q6_K": (_one_plain(vec_dot_k.dot2_q6_k), k_tokens.dot2x4_q6_k, k_tokens.dot2x2_q6_k, 2, _k_act),
}


def _run_kernels(layout, four, two, w, qs, d, bs, nb, rows, n_out, tokens):
    """The multi-token kernels over all rows for the token groups `tokens` -> y (n_tok, n_out)."""
    flat = w.reshape(-1)
    flat.flags.writeable = False
    rb = w.shape[1]
    y = np.zeros(qs.shape[0] * n_out, dtype=np.float32)
    extra = (bs.reshape(-1),) if layout == "Q4_K_X8" else ()  # (Q6_K's dots need no block sums)
    for r in range(0, n_out, rows):
        rb_arg = () if rows == 8 else (rb if r + 1 < n_out else 0,)
        for group in tokens:
            fn = four if len(group) == 4 else two
            fn(flat, r * rb, *rb_arg, qs.reshape(-1), d.reshape(-1), *extra, *group, nb, y, n_out, r)
    return y.reshape(qs.shape[0], n_out)


def _one_token(layout, w, qs, d, bs, nb, rows, n_out):
    flat = w.reshape(-1)
    flat.flags.writeable = False
    y = np.zeros((qs.shape[0], n_out), dtype=np.float32)
    for t in range(qs.shape[0]):
        if layout == "Q4_K_X8":
            for r in range(0, n_out, 8):
                q4_k_x8.dot8_q4_k_x8(flat, r * w.shape[1], qs[t], d[t], bs[t], nb, y[t], r)
            continue
        one = KERNEL_SETS[layout][0]
        for r in range(0, n_out, rows):
            one(flat, r * w.shape[1], w.shape[1] if r + 1 < n_out else 0, qs[t], d[t], bs if bs is None else bs[t],
                nb, y[t], r)
    return y


@pytest.mark.parametrize("generic", [False, True], ids=["host", "generic"])
@pytest.mark.parametrize("layout", list(KERNEL_SETS))
def test_multi_token_kernels_equal_the_one_token_kernel(layout, generic):
    """Each kernel, compiled afresh on the generic path (FORCE_GENERIC: the |q| / sign(q8) or vpmaddubsw sums
    without VNNI, in portable IR) or taken as compiled for the host (VNNI here), gives the host's 1-token floats for
    every token: 4-token groups with repeated tokens (a short last group), and 2-token groups."""
    _, four, two, rows, act = KERNEL_SETS[layout]
    rng = np.random.default_rng(11)
    n_out = 24 if rows == 8 else 7
    nb = 3
    _, w = _weight(layout, n_out, nb, rng)
    x = _x(7, nb * KERNELS[TYPES[layout][0]].block_size, rng)
    qs, d, bs = act(x)
    if generic:
        simd.FORCE_GENERIC[0] = True
        try:
            four, two = njit(four.py_func, fastmath=four.targetoptions["fastmath"]), \
                njit(two.py_func, fastmath=two.targetoptions["fastmath"])
            # compile now, while the flag holds
            y = _run_kernels(layout, four, two, w, qs, d, bs, nb, rows, n_out, [(0, 1, 2, 3), (4, 5, 6, 6), (5, 6)])
        finally:
            simd.FORCE_GENERIC[0] = False
    else:
        y = _run_kernels(layout, four, two, w, qs, d, bs, nb, rows, n_out, [(0, 1, 2, 3), (4, 5, 6, 6), (5, 6)])
    expect = _one_token(layout, w, qs, d, bs, nb, rows, n_out)
    assert np.isfinite(y).all()
    assert np.array_equal(y, expect), np.abs(y - expect).max()
