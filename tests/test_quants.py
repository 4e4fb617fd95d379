"""The quant registry and our reference dequantizers/quantizers, bit-exact against gguf-py."""

import ast
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest

from gguf_io.errors import GGUFFormatError, HybridError, UnsupportedQuantType
from gguf_io.quantize_ref import (
    Q8_K_SPEC, quantize_mxfp4, quantize_q4_0, quantize_q8_0, quantize_q8_k, quantize_q8_k_parts,
)
from gguf_io.quants import QUANTS, QuantSpec, quant_spec

NAMES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
         "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
# byte offsets of the fp16 scale fields per block (random bytes there would give NaN/inf scales)
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
               "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0],
               "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0]}


def sane_scales(name: str, raw: np.ndarray, rng: np.random.Generator) -> None:
    """Overwrite the scale fields of random blocks `raw` (n, type_size) with finite values of moderate size:
    fp16 fields, MXFP4's e8m0 exponent (2**-10 .. 2**9), IQ1_M's fp16 d spread over 4 nibbles."""
    n = raw.shape[0]
    if name == "MXFP4":
        raw[:, 0] = rng.integers(118, 138, n)
    elif name == "IQ1_M":  # d's nibble k is the top nibble of the u16 scales[k] (bytes 48..56)
        d = rng.uniform(-2.0, 2.0, n).astype("<f2").view("<u2")
        sc = raw[:, 48:56].copy().view("<u2")
        for k in range(4):
            sc[:, k] = (sc[:, k] & np.uint16(0x0FFF)) | (((d >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12))
        raw[:, 48:56] = sc.view(np.uint8)
    for off, dtype_scale in zip(FP16_FIELDS.get(name, ()), (2.0, 0.5)):
        raw[:, off:off + 2] = rng.uniform(-dtype_scale, dtype_scale, (n, 1)).astype("<f2").view(np.uint8)
KVALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
KV_MXFP4 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]


def random_blocks(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks `shape + (type_size,)` uint8 with finite, sane scale fields."""
    spec = QUANTS[name]
    n = int(np.prod(shape))
    if name == "F32":
        raw = rng.standard_normal(n).astype(np.float32).view(np.uint8)
    elif name == "F16":
        raw = (rng.standard_normal(n) * 10).astype(np.float16).view(np.uint8)
    elif name == "BF16":
        raw = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(n, spec.type_size), dtype=np.uint8)
        sane_scales(name, raw, rng)
    return raw.reshape(shape + (spec.type_size,))


def reference(raw: np.ndarray, name: str) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]), dtype=np.float32)


def assert_bit_equal(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


# ---- the registry -------------------------------------------------------------------------------

def test_registry_holds_exactly_the_supported_types():
    assert set(QUANTS) == set(NAMES)
    for name, spec in QUANTS.items():
        assert isinstance(spec, QuantSpec) and spec.name == name
        assert spec.type_id == gguf.GGMLQuantizationType[name].value
        assert (spec.block_size, spec.type_size) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


@pytest.mark.parametrize("name", NAMES)
def test_quant_spec_lookup(name):
    spec = QUANTS[name]
    assert quant_spec(name) is spec
    assert quant_spec(name.lower()) is spec
    assert quant_spec(spec.type_id) is spec
    assert quant_spec(gguf.GGMLQuantizationType[name]) is spec


@pytest.mark.parametrize("unknown", ["TQ1_0", 34, "Q8_K", 15, 9999, "nonsense"])
def test_quant_spec_unknown_raises(unknown):
    with pytest.raises(UnsupportedQuantType) as err:
        quant_spec(unknown)
    msg = str(err.value)
    assert "\n" not in msg and "Q4_K" in msg and "IQ4_XS" in msg and "MXFP4" in msg
    assert str(unknown) in msg or gguf.GGMLQuantizationType(unknown).name in msg


def test_row_bytes_and_nbytes():
    q4k = QUANTS["Q4_K"]
    assert q4k.row_bytes(512) == 288
    assert q4k.nbytes((3, 2, 256)) == 6 * 144
    assert QUANTS["F16"].nbytes((7, 5)) == 70
    assert QUANTS["Q8_0"].row_bytes(0) == 0
    with pytest.raises(GGUFFormatError, match="100"):
        q4k.row_bytes(100)
    with pytest.raises(HybridError):
        QUANTS["Q4_0"].nbytes((4, 33))


def test_spec_is_frozen():
    with pytest.raises(AttributeError):
        QUANTS["Q4_0"].block_size = 64


# ---- dequantizers, for every registered type ----------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_random_blocks_bit_exact(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    raw = random_blocks(name, (300,), rng).reshape(300 // 3, -1)  # 3 blocks a row
    ours = QUANTS[name].dequantize(raw)
    assert ours.shape == (100, 3 * QUANTS[name].block_size)
    assert np.isfinite(ours).all()
    assert_bit_equal(ours, reference(raw, name))


@pytest.mark.parametrize("name", NAMES)
def test_all_zero_block(name):
    spec = QUANTS[name]
    raw = np.zeros((2, spec.type_size), dtype=np.uint8)
    ours = spec.dequantize(raw)
    assert ours.shape == (2, spec.block_size)
    assert not ours.any()
    assert_bit_equal(ours, reference(raw, name))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lead", [(), (1,), (2, 3), (2, 1, 4)])
def test_leading_shapes(name, lead):
    spec = QUANTS[name]
    rng = np.random.default_rng(7)
    raw = random_blocks(name, lead + (2,), rng).reshape(lead + (2 * spec.type_size,))
    ours = spec.dequantize(raw)
    assert ours.shape == lead + (2 * spec.block_size,)
    assert_bit_equal(ours, reference(raw, name))
    # the same blocks flattened give the same values
    flat = spec.dequantize(raw.reshape(-1, spec.type_size))
    assert_bit_equal(ours.reshape(-1, spec.block_size), flat)


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_input_and_fresh_output(name):
    spec = QUANTS[name]
    raw = random_blocks(name, (4, 3), np.random.default_rng(3)).reshape(4, 3 * spec.type_size)
    view = raw[::2, : 2 * spec.type_size]  # rows 0 and 2, first two blocks
    ours = spec.dequantize(view)
    assert_bit_equal(ours, reference(np.ascontiguousarray(view), name))
    ours[...] = 0  # the output never aliases the raw bytes
    assert_bit_equal(spec.dequantize(view), reference(np.ascontiguousarray(view), name))


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_raises(name):
    spec = QUANTS[name]
    with pytest.raises(GGUFFormatError):
        spec.dequantize(np.zeros((2, spec.type_size + 1), dtype=np.uint8))
    with pytest.raises(TypeError):
        spec.dequantize(np.zeros((2, spec.type_size), dtype=np.int8))


# ---- hand-built blocks with values worked out by hand --------------------------------------------

def _block(name: str, **fields) -> np.ndarray:
    """A zero block of `name` with byte fields set: `at_<offset>=bytes-like or list[int]`, `f16_<offset>=float`."""
    raw = np.zeros(QUANTS[name].type_size, dtype=np.uint8)
    for key, value in fields.items():
        kind, off = key.split("_")
        off = int(off)
        if kind == "f16":
            raw[off:off + 2] = np.array([value], dtype="<f2").view(np.uint8)
        else:
            raw[off:off + len(value)] = value
    return raw


def _hand_built():
    """name -> (one raw block, {element index: expected value})."""
    nib = [j | ((15 - j) << 4) for j in range(16)]  # low nibbles 0..15, high nibbles 15..0
    q8 = np.arange(-128, 128, 8, dtype=np.int8).view(np.uint8)
    k4_scales = [0x43, 0, 0, 0, 0x02, 0, 0, 0, 0x31, 0, 0, 0]  # sc0=3 m0=2, sc4=17 m4=3, others 0
    return {
        "F32": (np.array([1.5, -2.0, 0.0], "<f4").view(np.uint8), {0: 1.5, 1: -2.0, 2: 0.0}),
        "F16": (np.array([0.5, -3.0, 65504.0], "<f2").view(np.uint8), {0: 0.5, 1: -3.0, 2: 65504.0}),
        "BF16": (np.array([0x3F80, 0xC000, 0x4049], "<u2").view(np.uint8), {0: 1.0, 1: -2.0, 2: 3.140625}),
        # block_q8_0: d=0.5, qs=-128,-120,...,120 -> -64,-60,...,60
        "Q8_0": (_block("Q8_0", f16_0=0.5, at_2=q8), {i: -64.0 + 4 * i for i in range(32)}),
        # block_q4_0: d=1, nibbles 0..15 -> -8..7, then 15..0 -> 7..-8
        "Q4_0": (_block("Q4_0", f16_0=1.0, at_2=nib), {**{j: j - 8.0 for j in range(16)},
                                                      **{16 + j: 7.0 - j for j in range(16)}}),
        # block_q4_1: d=0.5, m=-1 -> 0.5*q - 1
        "Q4_1": (_block("Q4_1", f16_0=0.5, f16_2=-1.0, at_4=nib), {0: -1.0, 15: 6.5, 16: 6.5, 31: -1.0}),
        # block_q5_0: d=2, qh bits 1 and 17, qs[1]=0x31 -> e1=(1|16)-16, e17=(3|16)-16, others -16
        "Q5_0": (_block("Q5_0", f16_0=2.0, at_2=[2, 0, 2, 0], at_7=[0x31]), {0: -32.0, 1: 2.0, 16: -32.0, 17: 6.0}),
        # block_q5_1: d=0.5, m=1, same bits: q = 0, 17, 19
        "Q5_1": (_block("Q5_1", f16_0=0.5, f16_2=1.0, at_4=[2, 0, 2, 0], at_9=[0x31]),
                 {0: 1.0, 1: 9.5, 16: 1.0, 17: 10.5}),
        # block_iq4_nl: d=0.5 -> half the table, then the table reversed
        "IQ4_NL": (_block("IQ4_NL", f16_0=0.5, at_2=nib), {**{j: KVALUES[j] / 2 for j in range(16)},
                                                          **{16 + j: KVALUES[15 - j] / 2 for j in range(16)}}),
        # block_q2_K: sub-block 0 scale 1 min 2, sub-block 1 scale 3, sub-block 8 scale 15 min 1; d=1, dmin=0.5
        # qs[0]=0b11100100 (crumbs 0,1,2,3 -> e0, e32, e64, e96), qs[16]=0xFF (e16...), qs[32]=1 (e128)
        "Q2_K": (_block("Q2_K", at_0=[0x21, 0x03, 0, 0, 0, 0, 0, 0, 0x1F], at_16=[0xE4], at_32=[0xFF], at_48=[1],
                        f16_80=1.0, f16_82=0.5),
                 {0: -1.0, 15: -1.0, 16: 9.0, 17: 0.0, 32: 0.0, 64: 0.0, 128: 14.5, 129: -0.5, 255: 0.0}),
        # block_q3_K: scale 0 = (0xA | 2<<4) - 32 = 10, all others -32; d=0.25
        # e0: q=3, hbit 1 -> 3; e1: q=0, hbit 0 -> -4; e2: hbit 1 -> 0; e128: qs[32]=2, hbit (bit 4 of hmask[0]) 1
        "Q3_K": (_block("Q3_K", at_0=[0x11, 0, 1], at_32=[3], at_64=[2], at_96=[0x0A, 0, 0, 0, 0, 0, 0, 0, 2],
                        f16_108=0.25),
                 {0: 7.5, 1: -10.0, 2: 0.0, 16: 32.0, 32: 32.0, 128: -16.0, 255: 32.0}),
        # block_q4_K: d=0.5, dmin=0.25; qs[0]=0x5A (e0=10, e32=5), qs[64]=0x0F (e128=15)
        "Q4_K": (_block("Q4_K", f16_0=0.5, f16_2=0.25, at_4=k4_scales, at_16=[0x5A], at_80=[0x0F]),
                 {0: 14.5, 1: -0.5, 31: -0.5, 32: 0.0, 128: 126.75, 129: -0.75, 160: 0.0, 255: 0.0}),
        # block_q5_K: as Q4_K plus qh[0] = bits 0 and 4 -> +16 on e0 and e128
        "Q5_K": (_block("Q5_K", f16_0=0.5, f16_2=0.25, at_4=k4_scales, at_16=[0x11], at_48=[0x5A], at_112=[0x0F]),
                 {0: 38.5, 1: -0.5, 32: 0.0, 128: 262.75, 129: -0.75}),
        # block_q6_K: d=0.5, scales 2,-1,4,1,...,sc8=-3; ql[0]=0x7F qh[0]=2 -> e0 = 15, e64 = 7-32;
        # ql[64]=3, qh[32]=3 -> e128 = 51-32; everything else -32
        "Q6_K": (_block("Q6_K", at_0=[0x7F], at_64=[0x03], at_128=[0x02], at_160=[0x03],
                        at_192=np.array([2, -1, 4, 1, 1, 1, 1, 1, -3, 1, 1, 1, 1, 1, 1, 1], np.int8).view(np.uint8),
                        f16_208=0.5),
                 {0: 15.0, 16: 16.0, 32: -64.0, 64: -12.5, 128: -28.5, 255: -16.0}),
        # block_iq4_xs: d=0.5, ls: ib0 = 1|2<<4 = 33, ib1 = 0|2<<4 = 32, ib7 = 15|3<<4 = 63, others 0
        "IQ4_XS": (_block("IQ4_XS", f16_0=0.5, at_2=[0x0A, 0xC0], at_4=[0x01, 0, 0, 0xF0], at_8=[0xF0],
                          at_40=[0x08], at_120=[0x09]),
                   {0: -63.5, 1: -63.5, 16: 56.5, 32: 0.0, 64: -16.0, 224: 201.5, 255: -1968.5}),
        # block_mxfp4: e=129 -> d = 2**(129-128) = 2 times the doubled e2m1 values; nibbles as in IQ4_NL
        "MXFP4": (_block("MXFP4", at_0=[129], at_1=nib), {**{j: 2.0 * KV_MXFP4[j] for j in range(16)},
                                                          **{16 + j: 2.0 * KV_MXFP4[15 - j] for j in range(16)}}),
        # Grid rows used below (gguf_io/iq_grids.py): iq2 grids: [0] = 8 x 8, [1] = 43, 8 x 7, iq2s_grid[256] =
        # 25,25,25,25,25,8,25,8; iq3xxs [0] = 4 x 4, [1] = 20,4,4,4; iq3s [0] = 1 x 4, [1] = 3,1,1,1,
        # [256] = 7,5,9,5; iq1s [0] = -1 x 8, [1] = 1, -1 x 7. ksigns[1] = 0x81, ksigns[2] = 0x82.
        # block_iq2_xxs: d=1; sub-block 0: grid indices 1,0,0,0, signs idx 1 (e0, e7 negative), s=3 -> db 0.875;
        # sub-block 1 all zero: db = 0.125
        "IQ2_XXS": (_block("IQ2_XXS", f16_0=1.0, at_2=[1, 0, 0, 0, 1, 0, 0, 0x30]),
                    {0: -37.625, 1: 7.0, 7: -7.0, 8: 7.0, 32: 1.0, 255: 1.0}),
        # block_iq2_xs: d=0.5; qs[0] = grid 1 | ksigns idx 2 << 9 (e1, e7 negative); scales[0] = 0x21:
        # db = 0.5 * 1.5 * 0.25 (e0..15), 0.5 * 2.5 * 0.25 (e16..31); scales[1] = 0 -> 0.0625
        "IQ2_XS": (_block("IQ2_XS", f16_0=0.5, at_2=[0x01, 0x04], at_66=[0x21]),
                   {0: 8.0625, 1: -1.5, 2: 1.5, 7: -1.5, 16: 2.5, 32: 0.5}),
        # block_iq2_s: d=1; qs[0]=0 with qh[0]=1 -> index 256; signs[0]=1 (e0 negative); scales[0]=1 ->
        # db 0.375 (e0..15), 0.125 (e16..31)
        "IQ2_S": (_block("IQ2_S", f16_0=1.0, at_34=[0x01], at_66=[0x01], at_74=[0x01]),
                  {0: -9.375, 1: 9.375, 5: 3.0, 7: 3.0, 8: 3.0, 16: 1.0}),
        # block_iq3_xxs: d=1; qs[0]=1 (e0..3 = 20,4,4,4), scales_and_signs[0] = 1 | 1 << 28: ksigns[1], db 0.75
        "IQ3_XXS": (_block("IQ3_XXS", f16_0=1.0, at_2=[1], at_66=[1, 0, 0, 0x10]),
                    {0: -15.0, 1: 3.0, 4: 3.0, 7: -3.0, 32: 1.0}),
        # block_iq3_s: d=0.5; qs[0]=1 (e0..3), qh[0]=2 -> qs[1] | 256 (e4..7 = 7,5,9,5); signs[0]=0x10 (e4
        # negative); scales[0]=2 -> db 2.5 for e0..31, 0.5 for e32..63
        "IQ3_S": (_block("IQ3_S", f16_0=0.5, at_2=[1], at_66=[2], at_74=[0x10], at_106=[2]),
                  {0: 7.5, 1: 2.5, 4: -17.5, 5: 12.5, 6: 22.5, 8: 2.5, 32: 0.5}),
        # block_iq1_s: d=1; qs[0]=1; qh[0] = 0xA000: s=2 (dl 5), delta -1/8; sub-block 1: dl 1, delta +1/8
        "IQ1_S": (_block("IQ1_S", f16_0=1.0, at_2=[1], at_34=[0x00, 0xA0]),
                  {0: 4.375, 1: -5.625, 8: -5.625, 32: -0.875}),
        # block_iq1_m: d = 1.0 = 0x3C00 in the top nibbles of scales (u16 2: 0xC, u16 3: 0x3); scales u16 0 = 0x11:
        # dl 3 (e0..15), 5 (e16..31); qs[0]=1; qh[0]=0x80: delta - for e8..15; e32..: dl 1, delta +
        "IQ1_M": (_block("IQ1_M", at_0=[1], at_32=[0x80], at_48=[0x11, 0, 0, 0, 0, 0xC0, 0, 0x30]),
                  {0: 3.375, 1: -2.625, 8: -3.375, 16: -4.375, 32: -0.875}),
    }


HAND_BUILT = _hand_built()


def test_every_type_has_a_hand_built_block():
    assert set(HAND_BUILT) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_hand_built_block(name):
    raw, expected = HAND_BUILT[name]
    ours = QUANTS[name].dequantize(raw)
    got = {i: float(ours[i]) for i in expected}
    assert got == expected
    assert_bit_equal(ours, reference(raw.reshape(1, -1), name).reshape(-1))


def test_dequantizers_are_our_own_code():
    src = Path(__file__).resolve().parents[1] / "gguf_io"
    for path in [*src.glob("quants*.py"), src / "quantize_ref.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("gguf.quants"), path
                assert not (node.module == "gguf" and any(a.name == "quants" for a in node.names)), path
            elif isinstance(node, ast.Import):
                assert all(not a.name.startswith("gguf.quants") for a in node.names), path


# ---- reference quantizers -----------------------------------------------------------------------

def _activations(rng: np.random.Generator, lead: tuple[int, ...], n: int) -> np.ndarray:
    x = np.concatenate([rng.standard_normal(lead + (n // 2,)) * 3, rng.standard_normal(lead + (n // 2,)) * 1e-3], -1)
    x = x.astype(np.float32)
    x.reshape(-1, n)[0, :32] = 0.0                          # an all-zero block
    x.reshape(-1, n)[0, 32:64] = np.arange(-16, 16) / 4.0    # exact quarters: rounding ties
    x.reshape(-1, n)[-1, :32] = np.tile([-3.0, 3.0], 16)    # equal magnitudes, the negative first
    return x


@pytest.mark.parametrize("qname,quantize", [("Q8_0", quantize_q8_0), ("Q4_0", quantize_q4_0)])
@pytest.mark.parametrize("lead", [(1,), (3, 2)])
def test_quantize_matches_gguf(qname, quantize, lead):
    x = _activations(np.random.default_rng(11), lead, 512)
    ours = quantize(x)
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType[qname])
    assert ours.dtype == np.uint8 and ours.shape == lead + (512 // 32 * QUANTS[qname].type_size,)
    assert np.array_equal(ours, theirs)
    # round trip: half a step for Q8_0 (plus the fp16 rounding of d, up to 127 * 2**-11 steps),
    # one step for Q4_0 (its grid -8..7 cannot reach -max); blocks whose d is not an fp16 subnormal
    xb = x.reshape(-1, 32)
    y = QUANTS[qname].dequantize(ours).reshape(-1, 32)
    step = np.abs(xb).max(-1, keepdims=True) / (127 if qname == "Q8_0" else 8)
    big = step[:, 0] > 1e-3
    assert big.sum() >= 8
    assert np.all(np.abs(y - xb)[big] <= (step * (0.6 if qname == "Q8_0" else 1.01))[big])


@pytest.mark.parametrize("lead", [(1,), (3, 2)])
def test_quantize_mxfp4_matches_gguf(lead):
    x = _activations(np.random.default_rng(13), lead, 512)
    ours = quantize_mxfp4(x)
    theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType.MXFP4)
    assert ours.dtype == np.uint8 and ours.shape == lead + (512 // 32 * 17,)
    assert np.array_equal(ours, theirs)
    # round trip: the e2m1 grid (0, .5, 1, 1.5, 2, 3, 4, 6) * 2**(e - 127) with max|x| in [4, 8) * 2**(e - 127):
    # errors are at most half the widest gap, 1 * 2**(e - 127) <= max|x| / 4 (plus 6..8 clipped to 6: <= 2 / 8)
    xb = x.reshape(-1, 32)
    y = QUANTS["MXFP4"].dequantize(ours).reshape(-1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    assert np.all(np.abs(y - xb) <= amax / 4 * 1.0001)


def _q8_k_scalar(xs: np.ndarray) -> tuple[np.float32, list[int], list[int]]:
    """quantize_row_q8_K_ref for one block, element by element (nearest_int = round half to even)."""
    amax, vmax = np.float32(0), np.float32(0)
    for v in xs:
        if abs(v) > amax:
            amax, vmax = abs(v), v
    if not amax:
        return np.float32(0), [0] * 256, [0] * 16
    iscale = np.float32(-127.0) / vmax
    qs = [min(127, int(np.rint(np.float32(iscale * v)))) for v in xs]
    return np.float32(1.0) / iscale, qs, [sum(qs[16 * j:16 * j + 16]) for j in range(16)]


def test_quantize_q8_k_matches_scalar_reference():
    x = _activations(np.random.default_rng(5), (2,), 512)
    x[1, 256:] = 0.0  # an all-zero super-block
    d, qs, bsums = quantize_q8_k_parts(x)
    assert d.shape == (2, 2) and qs.shape == (2, 2, 256) and bsums.shape == (2, 2, 16)
    assert d.dtype == np.float32 and qs.dtype == np.int8 and bsums.dtype == np.int16
    for r in range(2):
        for b in range(2):
            d_ref, qs_ref, bsums_ref = _q8_k_scalar(x[r, 256 * b:256 * (b + 1)])
            assert d[r, b].view(np.uint32) == d_ref.view(np.uint32)
            assert qs[r, b].tolist() == qs_ref and bsums[r, b].tolist() == bsums_ref


def test_quantize_q8_k_round_trip():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((3, 4, 1024)) * rng.uniform(1e-3, 1e3, (3, 4, 1))).astype(np.float32)
    raw = quantize_q8_k(x)
    assert raw.dtype == np.uint8 and raw.shape == (3, 4, 4 * Q8_K_SPEC.type_size)
    assert Q8_K_SPEC.type_size == 292 and Q8_K_SPEC.block_size == 256
    d, qs, bsums = quantize_q8_k_parts(x)
    blocks = raw.reshape(3, 4, 4, 292)
    assert np.array_equal(blocks[..., :4].copy().view("<f4")[..., 0], d)
    assert np.array_equal(blocks[..., 4:260].view(np.int8), qs)
    assert np.array_equal(blocks[..., 260:].copy().view("<i2"), bsums)
    assert np.array_equal(bsums, qs.reshape(3, 4, 4, 16, 16).sum(-1))
    y = Q8_K_SPEC.dequantize(raw)
    assert y.shape == x.shape
    xb = x.reshape(3, 4, 4, 256)
    amax = np.abs(xb).max(-1)
    assert np.allclose(np.abs(d), amax / 127, rtol=1e-6)
    err = np.abs(y.reshape(xb.shape) - xb)
    assert np.all(err <= (np.abs(d) * 0.5 * 1.001 + amax * 1e-6)[..., None])
    assert np.abs(qs).max() <= 127
