"""Small GGUF files for tests: valid ones, and deliberately damaged ones. The bytes come from `gguf_io.writer`.

    layout = build_gguf({"general.architecture": "llama", "llama.block_count": 2},
                        [Tensor("token_embd.weight", (64, 100), "F32")])
    path = write_gguf(tmp_path / "m.gguf", metadata, tensors)          # the same, written to a file
    metadata, tensors = tiny_model("qwen3", n_layer=2)                   # a consistent little model

Metadata is a dict or a list of (key, value) pairs (a list may repeat keys, and keys may be bytes, for damage).
Value types are inferred (bool -> BOOL, int -> U32/U64/I32/I64, float -> F32, str -> STRING, list/ndarray ->
ARRAY) or given explicitly with `Typed(VT.U8, 7)` / `Typed(VT.ARRAY, [1, 2], VT.I16)`. `build_gguf` returns a
`Layout`: the bytes and the offset of every part (see `Layout.offsets`), so a test can damage one exact field.

What is test-only lives here: type inference, deterministic default data, the damage knobs (passed on to the
writer's unchecked `encode_gguf`), `sample_metadata` and `tiny_model`. Unlike `gguf_io.writer.write_gguf`, a
factory file ends at its last data byte (no padding after the last tensor), so any cut of it cuts tensor data.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gguf_io import writer
from gguf_io.ggml_types import GGML_TYPE_IDS, GGML_TYPES
from gguf_io.metadata import VALUE_TYPE_NAMES

# GGUF metadata value types: VT.U8 = 0, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = 12.
VT = IntEnum("VT", [(n.upper(), i) for i, n in enumerate(VALUE_TYPE_NAMES)])
_KNOWN_VT = frozenset(map(int, VT))
_NP_VT = {"uint8": VT.U8, "int8": VT.I8, "uint16": VT.U16, "int16": VT.I16, "uint32": VT.U32, "int32": VT.I32,
          "float32": VT.F32, "bool": VT.BOOL, "uint64": VT.U64, "int64": VT.I64, "float64": VT.F64}


@dataclass
class Typed:
    """A metadata value with an explicit GGUF type (`elem_type` for arrays; a type id GGUF lacks is written
    with no payload, for damage)."""

    vtype: int
    value: Any
    elem_type: int | None = None


@dataclass
class Tensor:
    """A tensor to write. `ne` in ggml order (row width first); `ggml_type` an id or a name ("Q4_K").

    data: bytes or an ndarray (written with tobytes()); None draws deterministic data of the right size
    (normal floats for F32/F16, random bytes for the other types: quantized scales may be NaN/inf).
    offset: the data offset relative to the data section; None places it at the next aligned slot.
    n_dims: what to write as n_dims (damage); None writes len(ne). Negative ne are written modulo 2**64.
    """

    name: str | bytes
    ne: Sequence[int]
    ggml_type: int | str = "F32"
    data: bytes | np.ndarray | None = None
    offset: int | None = None
    n_dims: int | None = None

    @property
    def type_id(self) -> int:
        t = self.ggml_type
        return GGML_TYPE_IDS[t] if isinstance(t, str) else int(t)


@dataclass
class Layout:
    """The bytes of a GGUF file and where each part starts.

    offsets: "version", "n_tensors", "n_kv", "kv:<key>" (the key's length field), "value:<key>" (its value
    type field), "tensor_info:<name>", "tensor_infos_end", "data" (the data section), "tensor:<name>"
    (absolute data offset) and "end"; for a repeated key or name, its first one.
    """

    data: bytes
    offsets: dict[str, int] = field(default_factory=dict)
    alignment: int = 32


def tensor_nbytes(type_id: int, ne: Sequence[int]) -> int | None:
    t = GGML_TYPES.get(type_id)
    if t is None:
        return None
    return max(0, math.prod(int(x) for x in ne)) // t.block_size * t.type_size


def default_data(name: str | bytes, type_id: int, ne: Sequence[int]) -> bytes:
    nbytes = tensor_nbytes(type_id, ne) or 0
    if nbytes > 2**26:  # an impossible shape written for a damage test: no data
        return b""
    raw_name = name.encode() if isinstance(name, str) else name
    rng = np.random.default_rng(zlib.crc32(raw_name))
    if type_id in (0, 1):  # F32, F16
        dtype = np.float32 if type_id == 0 else np.float16
        return rng.normal(0.0, 0.5, size=nbytes // np.dtype(dtype).itemsize).astype(dtype).tobytes()
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8).tobytes()


def _infer(value) -> Typed:
    if isinstance(value, Typed):
        return value
    if isinstance(value, (bool, np.bool_)):
        return Typed(VT.BOOL, bool(value))
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if v >= 0:
            return Typed(VT.U32 if v < 2**32 else VT.U64, v)
        return Typed(VT.I32 if v >= -(2**31) else VT.I64, v)
    if isinstance(value, (float, np.floating)):
        return Typed(VT.F32, float(value))
    if isinstance(value, (str, bytes)):
        return Typed(VT.STRING, value)
    if isinstance(value, np.ndarray):
        return Typed(VT.ARRAY, value.tolist(), _NP_VT[value.dtype.name])
    if isinstance(value, (list, tuple)):
        first = _infer(value[0]).vtype if len(value) else VT.I32
        if first == VT.U32 and any(int(v) < 0 for v in value):
            first = VT.I32
        return Typed(VT.ARRAY, list(value), first)
    raise TypeError(f"cannot infer a GGUF type for {value!r}")


def _to_writer(value, element: bool = False) -> tuple[Any, Any]:
    """`value` as `gguf_io.writer`'s (value, vtype); the elements of an array of arrays are inferred one by one.
    A type id GGUF lacks (damage) becomes raw bytes: its type field(s), the element count, no payload."""
    t = _infer(value)
    etype = (VT.I32 if t.elem_type is None else t.elem_type) if t.vtype == VT.ARRAY else None
    if t.vtype not in _KNOWN_VT or (etype is not None and etype not in _KNOWN_VT):
        raw = b"" if etype is None else struct.pack("<IQ", etype, len(t.value))
        return (raw if element else struct.pack("<I", t.vtype) + raw), None
    if etype is None:
        return t.value, int(t.vtype)
    if etype == VT.ARRAY:
        return [_to_writer(v, element=True) for v in t.value], (int(VT.ARRAY), int(VT.ARRAY))
    return list(t.value), (int(VT.ARRAY), int(etype))


def encode_value(value) -> bytes:
    """The value-type field followed by the encoded value."""
    return writer.encode_value(*_to_writer(value))


def build_gguf(
    metadata: dict | Sequence[tuple] = (),
    tensors: Sequence[Tensor] = (),
    *,
    version: int = 3,
    alignment: int | None = None,
    magic: bytes = b"GGUF",
    n_tensors: int | None = None,
    n_kv: int | None = None,
) -> Layout:
    """Encode a GGUF file. `alignment` adds `general.alignment` (u32) unless the metadata has it.

    n_tensors / n_kv override the written counts (damage); the data section is padded as the file claims.
    """
    pairs = list(metadata.items()) if isinstance(metadata, dict) else list(metadata)
    keys = [k.encode() if isinstance(k, str) else k for k, _ in pairs]
    if alignment is not None and b"general.alignment" not in keys:
        pairs.append(("general.alignment", Typed(VT.U32, alignment)))
    claimed = dict(pairs).get("general.alignment", 32)
    claimed = claimed.value if isinstance(claimed, Typed) else claimed
    align = claimed if isinstance(claimed, int) and claimed > 0 else 32

    kvs = [(key, *_to_writer(value)) for key, value in pairs]
    records = []
    for t in tensors:
        data = default_data(t.name, t.type_id, t.ne) if t.data is None else t.data
        data = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        ne = [int(n) % 2**64 for n in t.ne]
        records.append((writer.TensorRecord(t.name, ne, t.type_id, t.offset, t.n_dims), data))
    data, offsets = writer.encode_gguf(kvs, records, align, pad_end=False, magic=magic, version=version,
                                       n_tensors=n_tensors, n_kv=n_kv)
    return Layout(data, offsets, align)


def write_gguf(path: str | Path, metadata: dict | Sequence[tuple] = (), tensors: Sequence[Tensor] = (), **kw) -> Path:
    """`build_gguf(...)` written to `path`; returns the path."""
    path = Path(path)
    path.write_bytes(build_gguf(metadata, tensors, **kw).data)
    return path


def sample_metadata() -> dict:
    """One key of every value type, arrays of several element types included."""
    return {
        "general.architecture": "llama",
        "general.name": "factory sample \u00e9\u4e2d",
        "test.u8": Typed(VT.U8, 200),
        "test.i8": Typed(VT.I8, -100),
        "test.u16": Typed(VT.U16, 60000),
        "test.i16": Typed(VT.I16, -30000),
        "test.u32": Typed(VT.U32, 4_000_000_000),
        "test.i32": Typed(VT.I32, -2_000_000_000),
        "test.f32": Typed(VT.F32, 0.15625),
        "test.bool": Typed(VT.BOOL, True),
        "test.u64": Typed(VT.U64, 2**63 + 5),
        "test.i64": Typed(VT.I64, -(2**62)),
        "test.f64": Typed(VT.F64, 1e-300),
        "test.empty_string": "",
        "test.strings": ["a", "", "\u00fc\u00f1\u00ee", "<0x0A>"],
        "test.f32s": Typed(VT.ARRAY, [0.5, -1.25, 3.0], VT.F32),
        "test.i32s": Typed(VT.ARRAY, [1, -2, 3], VT.I32),
        "test.bools": Typed(VT.ARRAY, [True, False, True], VT.BOOL),
        "test.u64s": Typed(VT.ARRAY, [0, 2**64 - 1], VT.U64),
        "test.empty_array": Typed(VT.ARRAY, [], VT.F32),
    }


def tiny_model(
    arch: str = "llama", *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
    head_dim: int | None = None, n_ff: int = 96, n_vocab: int = 40, n_expert: int = 4, n_expert_used: int = 2,
    n_ff_exp: int = 32, weight_type: str = "F32", tied: bool = True, vocab: bool = True, extra: dict | None = None,
) -> tuple[dict, list[Tensor]]:
    """(metadata, tensors) of a consistent little llama/qwen2/qwen3/qwen3moe/gemma3 model with llama.cpp's
    tensor names. Matrices are `weight_type` (row widths must fit its block size), norms and biases F32."""
    hd = head_dim or n_embd // n_head
    md: dict = {"general.architecture": arch, "general.name": f"tiny-{arch}", "general.file_type": 0,
                f"{arch}.context_length": 256, f"{arch}.embedding_length": n_embd, f"{arch}.block_count": n_layer,
                f"{arch}.feed_forward_length": n_ff, f"{arch}.attention.head_count": n_head,
                f"{arch}.attention.head_count_kv": n_head_kv, f"{arch}.rope.freq_base": 10000.0,
                f"{arch}.attention.layer_norm_rms_epsilon": 1e-6}
    if head_dim is not None:
        md[f"{arch}.attention.key_length"] = md[f"{arch}.attention.value_length"] = head_dim
    if arch == "qwen3moe":
        md.update({f"{arch}.expert_count": n_expert, f"{arch}.expert_used_count": n_expert_used,
                   f"{arch}.expert_feed_forward_length": n_ff_exp})
    if arch == "gemma3":
        md[f"{arch}.attention.sliding_window"] = 16
    if vocab:
        md["tokenizer.ggml.model"] = "llama"
        md["tokenizer.ggml.tokens"] = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, n_vocab)]
        md["tokenizer.ggml.scores"] = np.linspace(0, -1, n_vocab, dtype=np.float32)
        md["tokenizer.ggml.token_type"] = np.array([2, 3, 3] + [1] * (n_vocab - 3), dtype=np.int32)
    md.update(extra or {})

    def mat(name, n_in, *rest):
        return Tensor(name, (n_in, *rest), weight_type)

    def vec(name, n):
        return Tensor(name, (n,), "F32")

    ts = [mat("token_embd.weight", n_embd, n_vocab)]
    for i in range(n_layer):
        p = f"blk.{i}."
        ts += [vec(p + "attn_norm.weight", n_embd), mat(p + "attn_q.weight", n_embd, n_head * hd),
               mat(p + "attn_k.weight", n_embd, n_head_kv * hd), mat(p + "attn_v.weight", n_embd, n_head_kv * hd),
               mat(p + "attn_output.weight", n_head * hd, n_embd), vec(p + "ffn_norm.weight", n_embd)]
        if arch == "qwen2":
            ts += [vec(p + "attn_q.bias", n_head * hd), vec(p + "attn_k.bias", n_head_kv * hd),
                   vec(p + "attn_v.bias", n_head_kv * hd)]
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            ts += [vec(p + "attn_q_norm.weight", hd), vec(p + "attn_k_norm.weight", hd)]
        if arch == "gemma3":
            ts += [vec(p + "post_attention_norm.weight", n_embd), vec(p + "post_ffw_norm.weight", n_embd)]
        if arch == "qwen3moe":
            ts += [Tensor(p + "ffn_gate_inp.weight", (n_embd, n_expert), "F32"),
                   mat(p + "ffn_gate_exps.weight", n_embd, n_ff_exp, n_expert),
                   mat(p + "ffn_up_exps.weight", n_embd, n_ff_exp, n_expert),
                   mat(p + "ffn_down_exps.weight", n_ff_exp, n_embd, n_expert)]
        else:
            ts += [mat(p + "ffn_gate.weight", n_embd, n_ff), mat(p + "ffn_up.weight", n_embd, n_ff),
                   mat(p + "ffn_down.weight", n_ff, n_embd)]
    ts.append(vec("output_norm.weight", n_embd))
    if not tied:
        ts.append(mat("output.weight", n_embd, n_vocab))
    return md, ts
