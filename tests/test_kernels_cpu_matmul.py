"""CPU matmul on raw GGML blocks (kernels_cpu.matmul) vs float64 references, for every supported type;
the activation quantizers vs ggml's reference quantizers, bit for bit."""

import gguf
import gguf.quants
import numpy as np
import pytest

from gguf_io.errors import UnsupportedQuantType
from gguf_io.quantize_ref import quantize_q8_k_parts
from kernels_cpu import act_quant
from kernels_cpu.matmul import GEMM_MIN_TOKENS_AVX2, KERNELS, NEVER, matmul, matmuls
from reference import BASELINE_TYPES, matmul_baseline, quant_dot_legacy

NAMES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
         "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]

# nmse of the kernel vs float64 dequantize(w) @ x (x unconverted): dominated by converting the activations
# to the vec_dot_type (fp16/bf16 rounding, 8-bit quantization: llama.cpp's test-backend-ops allows 5e-4).
NMSE_TOL = {"F32": 1e-10, "F16": 1e-6, "BF16": 5e-5, **{n: 5e-4 for n in NAMES[3:]}}
# nmse vs float64 dequantize(w) @ (the converted activations): only float32 rounding is left.
NMSE_TOL_SAME_ACT = 1e-10

# byte offsets of the fp16 scale fields per block (random bytes there would give NaN/inf scales)
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
               "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0],
               "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0]}

# (n_out, n_blocks, n_tok): one block, one row, rows not divisible by 2 or 3 (nor by the 16-row tasks)
SHAPES = [(1, 1, 1), (5, 1, 5), (37, 3, 1), (19, 2, 5)]


def random_weight(name, n_out, n_in, rng):
    """Random raw rows (n_out, row_bytes) uint8 with sane fp16 scales; block 0 of row 0 is all zero
    (unless it is the only block)."""
    k = KERNELS[name]
    if name in ("F32", "F16", "BF16"):
        vals = rng.standard_normal((n_out, n_in)).astype(np.float32)
        if name == "F32":
            return vals.view(np.uint8)
        if name == "F16":
            return vals.astype(np.float16).view(np.uint8)
        return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = n_in // k.block_size
    w = rng.integers(0, 256, size=(n_out, nb, k.type_size), dtype=np.uint8)
    for off in FP16_FIELDS.get(name, ()):
        scale = rng.uniform(0.002, 0.05, (n_out, nb, 1)) * rng.choice([-1.0, 1.0], (n_out, nb, 1))
        w[:, :, off:off + 2] = scale.astype("<f2").view(np.uint8)
    if name == "MXFP4":  # block_mxfp4's e8m0 scale 2**(e - 128): 2**-9 .. 2**-5
        w[:, :, 0] = rng.integers(119, 124, (n_out, nb))
    elif name == "IQ1_M":  # block_iq1_m's fp16 d: nibble k on top of the u16 scales[k] (bytes 48..56)
        d = (rng.uniform(0.002, 0.05, (n_out, nb)) * rng.choice([-1.0, 1.0], (n_out, nb))).astype("<f2").view("<u2")
        sc = w[:, :, 48:56].copy().view("<u2")  # (n_out, nb, 4)
        for j in range(4):
            nib = (d >> np.uint16(4 * j)) & np.uint16(0xF)
            sc[..., j] = (sc[..., j] & np.uint16(0x0FFF)) | (nib << np.uint16(12))
        w[:, :, 48:56] = sc.view(np.uint8)
    if n_out * nb > 1:
        w[0, 0] = 0
    return w.reshape(n_out, nb * k.type_size)


def n_in_for(name, n_blocks):
    block = KERNELS[name].block_size
    return n_blocks * 32 + 1 if block == 1 else n_blocks * block  # float types: an odd width


def dequantize64(w, name):
    return np.asarray(gguf.quants.dequantize(w, gguf.GGMLQuantizationType[name]), dtype=np.float64)


def converted_activations(x, name):
    """The activations the kernel multiplies by, after conversion to the vec_dot_type, as float64."""
    vdt = KERNELS[name].vec_dot_type
    if vdt == "F32":
        return x.astype(np.float64)
    if vdt == "F16":
        return act_quant.round_to_f16(x).astype(np.float64)
    if vdt == "BF16":
        return act_quant.round_to_bf16(x).astype(np.float64)
    if vdt == "Q8_0":
        qs, d = act_quant.quantize_q8_0(x)
        return (qs.reshape(len(x), -1, 32) * d[:, :, None].astype(np.float64)).reshape(x.shape)
    qs, d, _ = act_quant.quantize_q8_k(x)
    return (qs.reshape(len(x), -1, 256) * d[:, :, None].astype(np.float64)).reshape(x.shape)


def quantize_q8_1_reference(x):
    """ggml's quantize_row_q8_1_ref: qs and d as block_q8_0's (gguf's own quantizer), s = fp16(sum(qs) * d) with
    d before its fp16 rounding -> (qs int8 (n, k), d float32 (n, k/32) fp16 values, s float32 (n, k/32))."""
    n, k = x.shape
    blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(n, k // 32, 34)
    d16 = np.ascontiguousarray(blocks[:, :, :2]).view("<f2")[..., 0].astype(np.float32)
    qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8)
    d = (np.abs(x.reshape(n, k // 32, 32)).max(axis=2) / np.float32(127.0)).astype(np.float32)  # unrounded
    s = (qs.sum(axis=2, dtype=np.int32).astype(np.float32) * d).astype(np.float16).astype(np.float32)
    return qs.reshape(n, k), d16, s


def min_term_correction(w, name, x):
    """ggml multiplies a Q4_1/Q5_1 block's min m by block_q8_1's s, not by d * sum(qs) of the converted
    activations: what that adds to converted_activations(x) @ W.T, float64 (n_tok, n_out); 0 for other types."""
    if name not in ("Q4_1", "Q5_1"):
        return 0.0
    qs, d16, s = quantize_q8_1_reference(x)
    nb = x.shape[1] // 32
    mins = np.ascontiguousarray(w.reshape(w.shape[0], nb, -1)[:, :, 2:4]).view("<f2")[..., 0].astype(np.float64)
    sums = qs.reshape(len(x), nb, 32).sum(axis=2).astype(np.float64)
    return (s.astype(np.float64) - d16.astype(np.float64) * sums) @ mins.T


def nmse(a, ref):
    return float(((a - ref) ** 2).sum() / (ref**2).sum())


# ---- the products -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", NAMES)
def test_matmul_matches_float64_reference(name, shape):
    n_out, n_blocks, n_tok = shape
    rng = np.random.default_rng(100 * NAMES.index(name) + SHAPES.index(shape))
    n_in = n_in_for(name, n_blocks)
    w = random_weight(name, n_out, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    y = matmul(w, name, x)
    assert y.dtype == np.float32 and y.shape == (n_tok, n_out)
    assert np.isfinite(y).all()
    w64 = dequantize64(w, name)
    assert nmse(y, converted_activations(x, name) @ w64.T + min_term_correction(w, name, x)) < NMSE_TOL_SAME_ACT
    if y.size > 1:  # for one output nmse is (err / y)**2, and y may cancel to near zero
        assert nmse(y, x.astype(np.float64) @ w64.T) < NMSE_TOL[name]


# Batches on both sides of the crossover of hosts without VNNI, passed explicitly so that every host runs both paths
# (integer dots below it, the float32 GEMM from it on), and all of them through the integer dots (as VNNI hosts
# send prefill of some types); 53 rows are not a multiple of the GEMM's 6-row tiles or 48-row tasks, and n_in spans
# more than one of its 256-wide k chunks.
BATCHES = [1, 2, 7, 17, 63, 64, 65]
CROSSOVERS = {"gemm_from_64": GEMM_MIN_TOKENS_AVX2, "int_dots": NEVER}


@pytest.mark.parametrize("gemm_from", CROSSOVERS.values(), ids=CROSSOVERS.keys())
@pytest.mark.parametrize("n_tok", BATCHES)
@pytest.mark.parametrize("name", NAMES)
def test_batch_sizes_on_both_paths(name, n_tok, gemm_from):
    rng = np.random.default_rng(1000 + 10 * NAMES.index(name) + BATCHES.index(n_tok))
    n_in = n_in_for(name, 2 if KERNELS[name].block_size == 256 else 9)
    w = random_weight(name, 53, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[-1, :32] = 0.0  # a zero block of activations
    y = matmul(w, name, x, gemm_from=gemm_from)
    assert y.shape == (n_tok, 53) and np.isfinite(y).all()
    w64 = dequantize64(w, name)
    assert nmse(y, converted_activations(x, name) @ w64.T + min_term_correction(w, name, x)) < NMSE_TOL_SAME_ACT
    assert nmse(y, x.astype(np.float64) @ w64.T) < NMSE_TOL[name]


# Several weights times one x (q/k/v, gate/up): K-quants and legacy types are fused per activation type, up to
# three a pass (a fourth K-quant starts a second pass), float types go alone; each result must be matmul's own.
MIXES = [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q6_K"), ("Q5_0", "Q8_0", "Q4_K", "F16"),
         ("Q4_K", "Q2_K", "Q3_K", "Q5_K", "IQ4_XS"), ("Q4_0", "Q4_1", "Q5_1", "IQ4_NL"),
         ("IQ2_XXS", "IQ3_S", "Q4_K", "IQ1_M", "IQ2_S"), ("MXFP4", "Q8_0", "IQ3_XXS", "IQ2_XS", "IQ1_S")]


@pytest.mark.parametrize("gemm_from", [None, *CROSSOVERS.values()], ids=["host", *CROSSOVERS.keys()])
@pytest.mark.parametrize("n_tok", [1, 3, 64])
@pytest.mark.parametrize("mix", MIXES, ids="+".join)
def test_matmuls_equal_matmul_one_by_one(mix, n_tok, gemm_from):
    rng = np.random.default_rng(7 + MIXES.index(mix))
    n_in = 512
    ws = [(random_weight(name, n_out, n_in, rng), name) for name, n_out in zip(mix, (53, 16, 37, 1, 70))]
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    got = matmuls(ws, x, gemm_from=gemm_from)
    assert len(got) == len(ws)
    for (w, name), y in zip(ws, got):
        ref = matmul(w, name, x, gemm_from=gemm_from)
        assert y.shape == ref.shape == (n_tok, w.shape[0])
        np.testing.assert_array_equal(y, ref, err_msg=name)  # the same kernels on the same rows: bit-identical
        assert nmse(y, converted_activations(x, name) @ dequantize64(w, name).T + min_term_correction(w, name, x)) < NMSE_TOL_SAME_ACT


def test_matmuls_checks_every_weight():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="features"):
        matmuls([(random_weight("Q4_K", 4, 256, rng), "Q4_K"), (random_weight("Q4_K", 4, 512, rng), "Q4_K")], x)
    with pytest.raises(UnsupportedQuantType):
        matmuls([(random_weight("Q4_K", 4, 256, rng), "Q4_K"), (np.zeros((4, 8), np.uint8), "Q9_X")], x)


@pytest.mark.parametrize("name", NAMES)
def test_1d_x_and_out_buffer(name):
    rng = np.random.default_rng(7)
    n_in = n_in_for(name, 2)
    w = random_weight(name, 9, n_in, rng)
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    y2 = matmul(w, name, x)
    y1 = matmul(w, name, x[1])
    assert y1.shape == (9,) and np.array_equal(y1, y2[1])
    out = np.full((3, 9), np.nan, dtype=np.float32)
    assert matmul(w, name, x, out=out) is out
    assert np.array_equal(out, y2)
    out1 = np.empty(9, dtype=np.float32)
    assert matmul(w, name, x[2], out=out1) is out1 and np.array_equal(out1, y2[2])


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "F16"])
def test_zero_weights_and_zero_activations(name):
    rng = np.random.default_rng(3)
    n_in = n_in_for(name, 2)
    w = random_weight(name, 4, n_in, rng)
    w[2] = 0  # an all-zero row: zero scales, zero codes
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    x[1] = 0.0  # a zero token: every activation block takes the d = 0 path
    x[2, :n_in // 2] = 0.0
    y = matmul(w, name, x)
    assert np.isfinite(y).all()
    assert np.all(y[:, 2] == 0) and np.all(y[1] == 0)
    assert nmse(y, converted_activations(x, name) @ dequantize64(w, name).T + min_term_correction(w, name, x)) < NMSE_TOL_SAME_ACT


def test_hand_built_q4_0_block():
    # d = 0.5, every byte 0x9A: low nibble 10 -> (10 - 8) * 0.5 = 1.0, high nibble 9 -> 0.5
    blk = np.concatenate([np.array([0.5], "<f2").view(np.uint8), np.full(16, 0x9A, np.uint8)])
    x = np.ones(32, dtype=np.float32)  # Q8_0: qs = 127, d = fp16(1/127)
    y = matmul(blk[None, :], "Q4_0", x)
    x_val = 127 * float(np.float16(np.float32(1) / np.float32(127)))
    assert y.shape == (1,) and y[0] == pytest.approx(16 * 1.5 * x_val, rel=1e-6)


def test_hand_built_q8_0_block():
    qs = np.arange(-16, 16, dtype=np.int8)
    blk = np.concatenate([np.array([0.25], "<f2").view(np.uint8), qs.view(np.uint8)])
    x = np.zeros(32, dtype=np.float32)
    x[[0, 31]] = [2.0, -1.0]  # d = 2/127: q8 = 127 and round(-63.5) = -64 (halves away from zero)
    d = float(np.float16(np.float32(2) / np.float32(127)))
    expected = 0.25 * d * (-16 * 127 + 15 * -64)
    assert matmul(blk[None, :], "Q8_0", x)[0] == pytest.approx(expected, rel=1e-6)


def test_memmap_weights(tmp_path):
    rng = np.random.default_rng(5)
    w = random_weight("Q6_K", 6, 512, rng)
    path = tmp_path / "w.bin"
    w.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r", shape=w.shape)
    x = rng.standard_normal(512).astype(np.float32)
    assert np.array_equal(matmul(mm, "Q6_K", x), matmul(w, "Q6_K", x))


# ---- dispatch and argument checks ------------------------------------------------------------------

def test_registry_covers_the_supported_types_with_ggml_geometry():
    assert list(KERNELS) == ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL",
                             "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4", "IQ2_XXS", "IQ2_XS",
                             "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
    for name, k in KERNELS.items():
        assert k.name == name
        assert (k.block_size, k.type_size) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


@pytest.mark.parametrize("type_name", ["Q8_1", "Q8_K", "TQ2_0", "TQ1_0", "NVFP4", "q4_k", 12, None])
def test_unregistered_type_raises(type_name):
    w = np.zeros((2, 144), dtype=np.uint8)
    with pytest.raises(UnsupportedQuantType, match="no CPU matmul kernel"):
        matmul(w, type_name, np.zeros(256, dtype=np.float32))


def test_bad_arguments_raise_value_error():
    w = np.zeros((4, 144), dtype=np.uint8)  # one Q4_K block per row: n_in = 256
    x = np.zeros((2, 256), dtype=np.float32)
    cases = [
        (w.astype(np.int8), x, None, "dtype uint8"),
        (w.reshape(4, 144, 1), x, None, "dimensions"),
        (np.zeros((4, 288), np.uint8)[:, ::2], x, None, "C-contiguous"),
        (np.zeros((4, 150), np.uint8), x, None, "whole Q4_K blocks"),
        (w, x.astype(np.float64), None, "dtype float32"),
        (w, np.zeros((2, 512), np.float32)[:, ::2], None, "C-contiguous"),
        (w, np.zeros((2, 255), np.float32), None, "255 features"),
        (w, np.zeros((1, 2, 256), np.float32), None, "dimensions"),
        (w, x, np.zeros((2, 5), np.float32), "expected \\(2, 4\\)"),
        (w, x, np.zeros((2, 4), np.float64), "dtype float32"),
        (w, x, np.zeros(4, np.float32), "dimensions"),
        ([[0] * 144] * 4, x, None, "numpy array"),
    ]
    for wi, xi, out, msg in cases:
        with pytest.raises(ValueError, match=msg):
            matmul(wi, "Q4_K", xi, out=out)


# ---- the pre-SIMD kernels (tests/reference) that scripts/bench_matmul.py --baseline times ----------------

def test_baseline_fp16_scales_are_exact_for_every_bit_pattern():
    h = np.arange(65536, dtype=np.uint16)
    ref = h.view(np.float16).astype(np.float32).view(np.uint32)
    nan = np.isnan(h.view(np.float16))
    scalar = np.array([quant_dot_legacy.f16_bits_to_f32(int(v)) for v in h], dtype=np.float32)  # block scales
    assert np.array_equal(scalar.view(np.uint32)[~nan], ref[~nan]) and np.isnan(scalar[nan]).all()


@pytest.mark.parametrize("name", BASELINE_TYPES)
def test_baseline_matches_float64_reference(name):
    rng = np.random.default_rng(2000 + NAMES.index(name))
    n_in = n_in_for(name, 2 if KERNELS[name].block_size == 256 else 9)
    w = random_weight(name, 37, n_in, rng)  # 37 rows: not a multiple of the 16-row tasks
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    y = matmul_baseline(w, name, x, np.empty((3, 37), dtype=np.float32))
    assert np.isfinite(y).all()
    w64 = dequantize64(w, name)
    # the baselines take Q4_1/Q5_1's min term as d16 * sum(q8) of the Q8_0 activations (no block_q8_1 s)
    assert nmse(y, converted_activations(x, name) @ w64.T) < NMSE_TOL_SAME_ACT
    assert nmse(y, x.astype(np.float64) @ w64.T) < NMSE_TOL[name]


# ---- activation conversion ---------------------------------------------------------------------------

def _activation_samples(rng, n):
    x = (rng.standard_normal((4, n)) * rng.uniform(0.01, 100, (4, 1))).astype(np.float32)
    x[1, :32] = 0.0  # an all-zero Q8_0 block
    x[2] = 0.0  # all-zero Q8_K blocks
    x[3, :32] = 0.0
    x[3, :8] = [127.0, 63.5, -63.5, 0.5, -0.5, 1.5, 2.5, -127.0]  # Q8_0 d = 1: halves round away from zero
    return x


def test_quantize_q8_0_bit_exact_with_ggml_reference():
    x = _activation_samples(np.random.default_rng(11), 512)
    qs, d = act_quant.quantize_q8_0(x)
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(4, 16, 34)  # block_q8_0
    ref_d = np.ascontiguousarray(ref[:, :, :2]).view("<f2")[..., 0].astype(np.float32)
    ref_qs = np.ascontiguousarray(ref[:, :, 2:]).view(np.int8).reshape(4, 512)
    assert np.array_equal(qs, ref_qs)
    assert np.array_equal(d.view(np.uint32), ref_d.view(np.uint32))


def test_quantize_q8_1_bit_exact_with_ggml_reference():
    """Q8_1 (the activations of Q4_1/Q5_1): Q8_0's qs and d, and s = fp16(d * sum(qs)) with the unrounded d."""
    x = _activation_samples(np.random.default_rng(13), 512)
    x[2, 64:96] = np.linspace(-3e-6, 5e-6, 32)  # d below fp16's normal range: s keeps precision d16 * sum loses
    qs, d, s = act_quant.quantize_q8_1(x)
    ref_qs, ref_d, ref_s = quantize_q8_1_reference(x)
    assert np.array_equal(qs, ref_qs) and np.array_equal(d.view(np.uint32), ref_d.view(np.uint32))
    assert np.array_equal(s.view(np.uint32), ref_s.view(np.uint32))
    sums = qs.reshape(4, 16, 32).sum(axis=2)
    assert not np.array_equal(s, d * sums)  # the case the kernels must not take as d16 * sum(qs)


def test_quantize_q8_k_bit_exact_with_ggml_reference():
    x = _activation_samples(np.random.default_rng(12), 768)
    qs, d, bsums = act_quant.quantize_q8_k(x)
    ref_d, ref_qs, ref_bsums = quantize_q8_k_parts(x)
    assert np.array_equal(qs, ref_qs.reshape(4, 768))
    assert np.array_equal(d.view(np.uint32), ref_d.view(np.uint32))
    assert np.array_equal(bsums, ref_bsums.reshape(4, 48))


def test_quantizers_on_ties_and_large_batches():
    rng = np.random.default_rng(15)
    x = (rng.standard_normal((70, 512)) * rng.uniform(0.001, 1000, (70, 1))).astype(np.float32)
    x[0, :256] = np.arange(-127.5, 128.5, 1.0, dtype=np.float32)[:256]  # amax 127.5: many halfway cases
    x[1, :32] = np.arange(-16, 16) + 0.5  # Q8_0 block with amax 16.5
    x[1, 32:64] = 0.0
    x[4:6, :256] = rng.uniform(-1, 1, (2, 256))
    x[4, 40], x[4, 50] = -3.0, 3.0  # +amax and -amax in one block: the first one wins (Q8_K)
    x[5, 40], x[5, 50] = 3.0, -3.0
    x[2, 300], x[2, 310] = 1e4, -1e4
    x[3, 256:] = -0.0
    qs, d = act_quant.quantize_q8_0(x)
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(70, 16, 34)
    assert np.array_equal(qs, np.ascontiguousarray(ref[:, :, 2:]).view(np.int8).reshape(70, 512))
    assert np.array_equal(d, np.ascontiguousarray(ref[:, :, :2]).view("<f2")[..., 0].astype(np.float32))
    qs, d, bsums = act_quant.quantize_q8_k(x)
    ref_d, ref_qs, ref_bsums = quantize_q8_k_parts(x)
    assert np.array_equal(qs, ref_qs.reshape(70, 512)) and np.array_equal(bsums, ref_bsums.reshape(70, 32))
    assert np.array_equal(d.view(np.uint32), ref_d.reshape(70, 2).view(np.uint32))


def test_f16_scale_rounding_matches_numpy():
    v = np.concatenate([np.random.default_rng(13).uniform(0, 2, 2000), [0.0, 6e-8, 3e-8, 65504.0, 65519.0,
                        65520.0, 1e6, 2.0**-14, 2.0**-24 * 1.5, 1.0 + 2.0**-11]]).astype(np.float32)
    ours = np.array([act_quant.f32_to_f16_value(t) for t in v], dtype=np.float32)
    with np.errstate(over="ignore"):
        assert np.array_equal(ours, v.astype(np.float16).astype(np.float32))


def test_round_to_bf16_matches_gguf():
    x = np.random.default_rng(14).standard_normal(4096).astype(np.float32)
    x[:4] = [np.inf, -np.inf, np.nan, 1.0 + 2.0**-8]
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)
    ours = act_quant.round_to_bf16(x).view(np.uint32)
    assert np.array_equal(ours >> 16, ref.view(np.uint16).astype(np.uint32)) and np.all(ours & 0xFFFF == 0)
