"""Write small GGUF files byte by byte (struct only) for tests: valid ones, and deliberately damaged ones.

    layout = build_gguf({"general.architecture": "llama", "llama.block_count": 2},
                        [Tensor("token_embd.weight", (64, 100), "F32")])
    path = write_gguf(tmp_path / "m.gguf", metadata, tensors)          # the same, written to a file
    metadata, tensors = tiny_model("qwen3", n_layer=2)                   # a consistent little model

Metadata is a dict or a list of (key, value) pairs (a list may repeat keys, and keys may be bytes, for damage).
Value types are inferred (bool -> BOOL, int -> U32/U64/I32/I64, float -> F32, str -> STRING, list/ndarray ->
ARRAY) or given explicitly with `Typed(VT.U8, 7)` / `Typed(VT.ARRAY, [1, 2], VT.I16)`. `build_gguf` returns a
`Layout`: the bytes and the offset of every part (see `Layout.offsets`), so a test can damage one exact field.
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
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType


class VT(IntEnum):
    """GGUF metadata value types."""

    U8 = 0
    I8 = 1
    U16 = 2
    I16 = 3
    U32 = 4
    I32 = 5
    F32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    U64 = 10
    I64 = 11
    F64 = 12


_FMT = {VT.U8: "<B", VT.I8: "<b", VT.U16: "<H", VT.I16: "<h", VT.U32: "<I", VT.I32: "<i", VT.F32: "<f",
        VT.BOOL: "<B", VT.U64: "<Q", VT.I64: "<q", VT.F64: "<d"}
_NP_VT = {"uint8": VT.U8, "int8": VT.I8, "uint16": VT.U16, "int16": VT.I16, "uint32": VT.U32, "int32": VT.I32,
          "float32": VT.F32, "bool": VT.BOOL, "uint64": VT.U64, "int64": VT.I64, "float64": VT.F64}


@dataclass
class Typed:
    """A metadata value with an explicit GGUF type (`elem_type` for arrays)."""

    vtype: int
    value: Any
    elem_type: int | None = None


@dataclass
class Tensor:
    """A tensor to write. `ne` in ggml order (row width first); `ggml_type` an id or a name ("Q4_K").

    data: bytes or an ndarray (written with tobytes()); None draws deterministic data of the right size
    (normal floats for F32/F16, random bytes for the other types: quantized scales may be NaN/inf).
    offset: the data offset relative to the data section; None places it at the next aligned slot.
    n_dims: what to write as n_dims (damage); None writes len(ne).
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
        return int(GGMLQuantizationType[t]) if isinstance(t, str) else int(t)


@dataclass
class Layout:
    """The bytes of a GGUF file and where each part starts.

    offsets: "version", "n_tensors", "n_kv", "kv:<key>" (the key's length field), "value:<key>" (its value
    type field), "tensor_info:<name>", "tensor_infos_end", "data" (the data section), "tensor:<name>"
    (absolute data offset) and "end".
    """

    data: bytes
    offsets: dict[str, int] = field(default_factory=dict)
    alignment: int = 32


def tensor_nbytes(type_id: int, ne: Sequence[int]) -> int | None:
    try:
        bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (KeyError, ValueError):
        return None
    return max(0, math.prod(int(x) for x in ne)) // bs * ts


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


def _string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


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


def encode_value(value) -> bytes:
    """The value-type field followed by the encoded value."""
    t = _infer(value)
    return struct.pack("<I", int(t.vtype)) + _encode_payload(t)


def _encode_payload(t: Typed) -> bytes:
    if t.vtype == VT.STRING:
        return _string(t.value)
    if t.vtype == VT.ARRAY:
        et = VT.I32 if t.elem_type is None else t.elem_type
        items = list(t.value)
        body = b"".join(_encode_payload(_infer(Typed(et, v)) if et != VT.ARRAY else _infer(v)) for v in items)
        return struct.pack("<IQ", int(et), len(items)) + body
    fmt = _FMT.get(t.vtype)
    if fmt is None:
        return b""  # an unknown type id (damage): no payload
    return struct.pack(fmt, t.value)


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

    out = bytearray(magic)
    lay = Layout(b"", {}, align)
    lay.offsets["version"] = len(out)
    out += struct.pack("<I", version)
    lay.offsets["n_tensors"] = len(out)
    out += struct.pack("<Q", len(tensors) if n_tensors is None else n_tensors)
    lay.offsets["n_kv"] = len(out)
    out += struct.pack("<Q", len(pairs) if n_kv is None else n_kv)
    for key, value in pairs:
        name = key if isinstance(key, str) else key.decode("utf-8", "replace")
        lay.offsets.setdefault(f"kv:{name}", len(out))
        out += _string(key)
        lay.offsets.setdefault(f"value:{name}", len(out))
        out += encode_value(value)

    # Place the data: explicit offsets as given, the others one after another, aligned.
    blobs, rel_offsets, cursor = [], [], 0
    for t in tensors:
        data = default_data(t.name, t.type_id, t.ne) if t.data is None else t.data
        data = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        rel = -(-cursor // align) * align if t.offset is None else t.offset
        blobs.append(data)
        rel_offsets.append(rel)
        if data:  # a tensor written without data (damage) takes no room, wherever its offset points
            cursor = max(cursor, rel + len(data))
    for t, rel in zip(tensors, rel_offsets):
        name = t.name if isinstance(t.name, str) else t.name.decode("utf-8", "replace")
        lay.offsets[f"tensor_info:{name}"] = len(out)
        out += _string(t.name)
        out += struct.pack("<I", len(t.ne) if t.n_dims is None else t.n_dims)
        out += b"".join(struct.pack("<Q", int(n) % 2**64) for n in t.ne)
        out += struct.pack("<IQ", t.type_id, rel)
    lay.offsets["tensor_infos_end"] = len(out)
    data_start = -(-len(out) // align) * align
    out += bytes(data_start - len(out))
    lay.offsets["data"] = data_start
    section = bytearray(cursor)
    for t, rel, blob in zip(tensors, rel_offsets, blobs):
        if blob:
            section[rel : rel + len(blob)] = blob
        name = t.name if isinstance(t.name, str) else t.name.decode("utf-8", "replace")
        lay.offsets[f"tensor:{name}"] = data_start + rel
    out += section
    lay.offsets["end"] = len(out)
    lay.data = bytes(out)
    return lay


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
