"""kernels_cpu.get_rows (the compiled embedding lookup) vs the numpy reference dequantizers and gguf's own."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf import GGMLQuantizationType

from gguf_io import quant_spec
from kernels_cpu import q8_0_x8
from kernels_cpu.get_rows import PARALLEL_ROWS, TYPES, get_rows


def _raw(type_name: str, n_rows: int, n_cols: int, rng) -> np.ndarray:
    """Random rows of blocks whose fp16 fields are finite values of sane size (random bytes elsewhere)."""
    _, block_bytes, block_vals = TYPES[type_name]
    raw = rng.integers(0, 256, (n_rows, n_cols // block_vals * block_bytes), dtype=np.uint8)
    if type_name in ("F32", "F16"):
        vals = rng.standard_normal((n_rows, n_cols)).astype(np.float32 if type_name == "F32" else np.float16)
        return np.ascontiguousarray(vals).view(np.uint8)
    blocks = raw.reshape(n_rows, -1, block_bytes)
    offsets = {"Q8_0": (0,), "Q4_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}[type_name]
    for off in offsets:
        h = (rng.standard_normal(blocks.shape[:2]) * 0.01).astype(np.float16)
        h[0, 0] = np.float16(6e-8)  # a subnormal scale
        blocks[:, :, off:off + 2] = h.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return raw


@pytest.mark.parametrize("type_name", sorted(t for t in TYPES if not t.endswith("_X8")))
def test_get_rows_is_the_reference_bit_for_bit(type_name):
    rng = np.random.default_rng(len(type_name))
    n_cols = 512
    raw = _raw(type_name, 40, n_cols, rng)
    ids = np.array([3, 0, 39, 3, 17], dtype=np.int64)
    got = get_rows(raw, type_name, ids)
    ref = quant_spec(type_name).dequantize(raw[ids])
    assert got.shape == (5, n_cols) and got.dtype == np.float32
    np.testing.assert_array_equal(got, ref)
    independent = gguf_dequantize(raw[ids], GGMLQuantizationType[type_name]).astype(np.float32)
    np.testing.assert_array_equal(got, independent)


@pytest.mark.parametrize("type_name", sorted(t for t in TYPES if not t.endswith("_X8")) + ["Q8_0_X8"])
def test_a_prompts_rows_decoded_on_threads_are_the_same(type_name):
    """From PARALLEL_ROWS rows the lookup runs on numba's threads: the same values as row by row."""
    rng = np.random.default_rng(7)
    plain = _raw("Q8_0" if type_name == "Q8_0_X8" else type_name, 48, 256, rng)
    raw = q8_0_x8.repack(plain) if type_name == "Q8_0_X8" else plain
    ids = rng.integers(0, 48, PARALLEL_ROWS + 37)
    got = get_rows(raw, type_name, ids)
    assert got.shape == (ids.size, 256)
    each = np.concatenate([get_rows(raw, type_name, ids[i:i + 1]) for i in range(ids.size)])  # one row a call
    np.testing.assert_array_equal(got, each)
    ref = quant_spec("Q8_0" if type_name == "Q8_0_X8" else type_name).dequantize(plain[ids])
    np.testing.assert_array_equal(got, ref)


def test_get_rows_reads_q8_0_rows_interleaved_by_8():
    """A tied Q8_0 output repacked at load (kernels_cpu.q8_0_x8) is looked up in place: gguf's rows bit for bit."""
    rng = np.random.default_rng(8)
    raw = _raw("Q8_0", 40, 512, rng)
    ids = np.array([3, 0, 39, 3, 17, 8, 7], dtype=np.int64)
    got = get_rows(q8_0_x8.repack(raw), "Q8_0_X8", ids)
    np.testing.assert_array_equal(got, gguf_dequantize(raw[ids], GGMLQuantizationType.Q8_0).astype(np.float32))
    with pytest.raises(IndexError):
        get_rows(q8_0_x8.repack(raw), "Q8_0_X8", np.array([40]))


def test_get_rows_other_types_and_bad_ids():
    raw = np.zeros((4, 110), dtype=np.uint8)
    assert get_rows(raw, "Q3_K", np.array([0])) is None  # not decoded here: the caller's reference runs
    with pytest.raises(IndexError):
        get_rows(np.zeros((4, 34), dtype=np.uint8), "Q8_0", np.array([4]))
