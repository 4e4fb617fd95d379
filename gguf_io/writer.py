"""Writing GGUF v3 files: the one encoder of the format in this repository.

Writes what `gguf_io.open_gguf` reads (and llama.cpp loads) without the `gguf` package, so synthetic models can
be made on machines that lack it. The building blocks:

    encode_string / encode_value     a string; a metadata value with its type field (arrays, nested ones too)
    encode_tensor_info               one tensor-info record (`TensorRecord`)
    encode_header                    magic .. tensor infos, padded to the alignment, and where each part starts
    place_tensors / align            where each tensor's data goes: the next aligned slot, or an offset given
    encode_gguf                      a whole small file in memory (the test factory's writer)
    layout + write_gguf              a streaming writer: each tensor's data comes from an iterator of byte chunks,
                                     so a multi-GiB file never sits in memory (the synthetic model generator)

`encode_header` and `encode_gguf` can write what the format forbids (another magic or version, wrong counts,
any n_dims or type id, unaligned or overlapping offsets, pre-encoded raw values) so that tests/gguf_factory.py
can make damaged files for the reader's error tests from the same encoder; `layout` never does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

from gguf_io.ggml_types import GGML_TYPE_IDS, GGML_TYPES
from gguf_io.metadata import ARRAY, BOOL, F32, F64, I8, I16, I32, I64, STRING, U8, U16, U32, U64

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32
_SCALAR_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
               U64: "<Q", I64: "<q", F64: "<d"}
_ARRAY_DTYPE = {U8: "u1", I8: "i1", U16: "<u2", I16: "<i2", U32: "<u4", I32: "<i4", F32: "<f4", BOOL: "u1",
                U64: "<u8", I64: "<i8", F64: "<f8"}


@dataclass(frozen=True)
class TensorEntry:
    """A tensor to write: `ne` in ggml order (ne[0] = row width), `type_name` a GGML type ("Q4_K")."""

    name: str
    ne: tuple[int, ...]
    type_name: str

    @property
    def type_id(self) -> int:
        return GGML_TYPE_IDS[self.type_name]

    @property
    def n_elements(self) -> int:
        n = 1
        for x in self.ne:
            n *= int(x)
        return n

    @property
    def nbytes(self) -> int:
        t = GGML_TYPES[self.type_id]
        if self.ne[0] % t.block_size:
            raise ValueError(f"{self.name}: row width {self.ne[0]} is not whole {t.name} blocks of {t.block_size}")
        return self.n_elements // t.block_size * t.type_size


class TensorRecord(NamedTuple):
    """One tensor-info record as it is written, unchecked: `ne` in ggml order (each 0..2**64-1), any `type_id`,
    `offset` relative to the data section (None in `encode_gguf`: the next aligned slot), `n_dims` the dimension
    count written (None: len(ne))."""

    name: str | bytes
    ne: Sequence[int]
    type_id: int
    offset: int | None = None
    n_dims: int | None = None


def align(n: int, alignment: int) -> int:
    """`n` rounded up to a multiple of `alignment`."""
    return -(-n // alignment) * alignment


def encode_string(s: str | bytes) -> bytes:
    """A GGUF string: u64 length, then the bytes (a str as UTF-8; bytes as they are, valid UTF-8 or not)."""
    b = bytes(s) if isinstance(s, (bytes, bytearray)) else s.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(b)) + b  # the reader decodes with surrogateescape: round trip


# A metadata value's `vtype`, as in `GGUFFile.metadata_types`: a scalar type, or (ARRAY, element type); for an
# array of arrays the element type is ARRAY and each element a (value, vtype) pair. None: the value is already
# encoded (bytes, written as they are: a hook for deliberately malformed values).
def _array_body(value, etype: int) -> bytes:
    if etype == STRING:
        return b"".join([encode_string(s) for s in value])
    if etype == ARRAY:
        return b"".join([encode_payload(v, t) for v, t in value])
    dtype = np.dtype(_ARRAY_DTYPE[etype])
    if not isinstance(value, np.ndarray):
        return np.array(value, dtype=dtype).tobytes()  # Python ints out of range raise OverflowError
    out = value.astype(dtype, copy=False)
    if value.size and value.dtype.kind in "biu" and dtype.kind in "iu" and not np.array_equal(out, value):
        raise ValueError(f"array values out of range for GGUF type {etype}")
    return out.tobytes()


def encode_payload(value, vtype) -> bytes:
    """A metadata value without its type field (what an array element is)."""
    if vtype is None:
        return bytes(value)
    if isinstance(vtype, tuple):
        _, etype = vtype
        return struct.pack("<IQ", etype, len(value)) + _array_body(value, etype)
    if vtype == STRING:
        return encode_string(value)
    return struct.pack(_SCALAR_FMT[vtype], value)


def encode_value(value, vtype) -> bytes:
    """The value-type field and the encoded value (`vtype` as in `GGUFFile.metadata_types`, or None: raw)."""
    if vtype is None:
        return bytes(value)
    return struct.pack("<I", ARRAY if isinstance(vtype, tuple) else vtype) + encode_payload(value, vtype)


def encode_tensor_info(t: TensorRecord) -> bytes:
    """name, n_dims, ne[n], type id, offset."""
    n_dims = len(t.ne) if t.n_dims is None else t.n_dims
    return encode_string(t.name) + struct.pack(f"<I{len(t.ne)}QIQ", n_dims, *t.ne, t.type_id, t.offset)


def _label(s: str | bytes) -> str:
    return s if isinstance(s, str) else bytes(s).decode("utf-8", "replace")


def encode_header(metadata: Sequence[tuple[str | bytes, object, object]], tensors: Sequence[TensorRecord],
                  alignment: int = DEFAULT_ALIGNMENT, *, magic: bytes = GGUF_MAGIC, version: int = GGUF_VERSION,
                  n_tensors: int | None = None, n_kv: int | None = None) -> tuple[bytes, dict[str, int]]:
    """Everything before the data section, zero-padded to `alignment`, and where each part starts.

    `metadata`: (key, value, vtype) triples in file order (a key may repeat). `n_tensors` / `n_kv` replace the
    counts written. Parts: "version", "n_tensors", "n_kv", "kv:<key>" (its length field), "value:<key>" (its
    type field), "tensor_info:<name>", "tensor_infos_end" and "data"; a repeated key or name: its first one."""
    out, parts = bytearray(magic), {}

    def put(part: str, b: bytes) -> None:
        parts.setdefault(part, len(out))
        out.extend(b)

    put("version", struct.pack("<I", version))
    put("n_tensors", struct.pack("<Q", len(tensors) if n_tensors is None else n_tensors))
    put("n_kv", struct.pack("<Q", len(metadata) if n_kv is None else n_kv))
    for key, value, vtype in metadata:
        put(f"kv:{_label(key)}", encode_string(key))
        put(f"value:{_label(key)}", encode_value(value, vtype))
    for t in tensors:
        put(f"tensor_info:{_label(t.name)}", encode_tensor_info(t))
    put("tensor_infos_end", bytes(align(len(out), alignment) - len(out)))  # the padding
    parts["data"] = len(out)
    return bytes(out), parts


def place_tensors(sizes: Sequence[int], alignment: int = DEFAULT_ALIGNMENT,
                  offsets: Sequence[int | None] | None = None) -> tuple[list[int], int]:
    """Where each tensor's data goes, relative to the data section, and where the last data byte ends (unpadded).

    A tensor goes at the next aligned slot after all data placed before it, or at its entry in `offsets` when
    that is not None (as given: unaligned or overlapping ones too). A tensor of no bytes takes no room."""
    placed, end = [], 0
    for size, fixed in zip(sizes, [None] * len(sizes) if offsets is None else offsets):
        at = align(end, alignment) if fixed is None else fixed
        placed.append(at)
        if size:
            end = max(end, at + size)
    return placed, end


def encode_gguf(metadata: Sequence[tuple[str | bytes, object, object]], tensors: Sequence[tuple[TensorRecord, bytes]],
                alignment: int = DEFAULT_ALIGNMENT, *, pad_end: bool = True, **header) -> tuple[bytes, dict[str, int]]:
    """A whole file in memory, and where each part starts (`encode_header`'s parts, then "tensor:<name>", the
    absolute data offset, and "end"). `tensors`: (record, data bytes) pairs; a record's offset None places its
    data at the next aligned slot (`place_tensors`). Zero bytes fill the gaps, and with `pad_end` the file ends
    on a multiple of `alignment` (as `write_gguf` writes it); without, it ends at the last data byte.
    `header`: `encode_header`'s overrides (magic, version, n_tensors, n_kv)."""
    offsets, end = place_tensors([len(d) for _, d in tensors], alignment, [t.offset for t, _ in tensors])
    records = [t._replace(offset=at) for (t, _), at in zip(tensors, offsets)]
    head, parts = encode_header(metadata, records, alignment, **header)
    section = bytearray(align(end, alignment) if pad_end else end)
    for t, (_, data) in zip(records, tensors):
        if data:
            section[t.offset : t.offset + len(data)] = data
        parts.setdefault(f"tensor:{_label(t.name)}", len(head) + t.offset)
    parts["end"] = len(head) + len(section)
    return head + section, parts


@dataclass(frozen=True)
class GGUFLayout:
    """The encoded header (magic .. tensor infos, padded) and where each tensor's data goes."""

    header: bytes  # already padded to the alignment: the data section starts at len(header)
    offsets: tuple[int, ...]  # per tensor, relative to the data section
    file_size: int  # header + every tensor, each padded to the alignment


def layout(metadata: Sequence[tuple[str, object, int | tuple[int, int]]], tensors: Sequence[TensorEntry],
           alignment: int = DEFAULT_ALIGNMENT) -> GGUFLayout:
    """Encode the header. `metadata`: (key, value, vtype) triples in file order; `general.alignment` must be
    among them when `alignment` is not the default 32."""
    offsets, end = place_tensors([t.nbytes for t in tensors], alignment)
    records = [TensorRecord(t.name, t.ne, t.type_id, at) for t, at in zip(tensors, offsets)]
    header, _ = encode_header(metadata, records, alignment)
    return GGUFLayout(header, tuple(offsets), len(header) + align(end, alignment))


def write_gguf(path: str | Path, lay: GGUFLayout, tensors: Sequence[TensorEntry],
               data: Callable[[TensorEntry], Iterable[np.ndarray | bytes]],
               alignment: int = DEFAULT_ALIGNMENT, on_tensor: Callable[[int, TensorEntry], None] | None = None) -> int:
    """Write the file: the header of `lay`, then each tensor's bytes from `data(entry)` (chunks, in order),
    padded to the alignment. `on_tensor(i, entry)` is called after each tensor. Returns the file size."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")  # renamed when complete: no half-written model under `path`
    try:
        with open(tmp, "wb") as fh:
            fh.write(lay.header)
            for i, t in enumerate(tensors):
                written = 0
                for chunk in data(t):
                    mv = memoryview(chunk).cast("B") if isinstance(chunk, np.ndarray) else memoryview(chunk)
                    fh.write(mv)
                    written += len(mv)
                if written != t.nbytes:
                    raise ValueError(f"{t.name}: the data gave {written} bytes, expected {t.nbytes}")
                fh.write(bytes(align(written, alignment) - written))
                if on_tensor is not None:
                    on_tensor(i, t)
            size = fh.tell()
        if size != lay.file_size:
            raise AssertionError(f"wrote {size} bytes, the layout planned {lay.file_size}")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return size
