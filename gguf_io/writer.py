"""A small streaming GGUF v3 writer: typed metadata, the tensor table, aligned data written tensor by tensor.

Writes what `gguf_io.open_gguf` reads (and llama.cpp loads) without the `gguf` package, so synthetic models can
be made on machines that lack it. The data of each tensor comes from an iterator of byte chunks, so a
multi-GiB file never sits in memory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from gguf_io.ggml_types import GGML_TYPE_IDS, GGML_TYPES
from gguf_io.metadata import ARRAY, BOOL, F32, F64, I8, I16, I32, I64, STRING, U8, U16, U32, U64

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


def _string(s: str) -> bytes:
    b = s.encode("utf-8", "surrogateescape")  # the reader decodes with surrogateescape: round trip
    return struct.pack("<Q", len(b)) + b


def encode_value(value, vtype: int | tuple[int, int]) -> bytes:
    """The value-type field and the encoded value (`vtype` as in `GGUFFile.metadata_types`)."""
    if isinstance(vtype, tuple):
        _, etype = vtype
        if etype == STRING:
            body = b"".join([_string(s) for s in value])
        else:
            body = np.asarray(value).astype(_ARRAY_DTYPE[etype], copy=False).tobytes()
        return struct.pack("<IIQ", ARRAY, etype, len(value)) + body
    if vtype == STRING:
        return struct.pack("<I", STRING) + _string(value)
    return struct.pack("<I", vtype) + struct.pack(_SCALAR_FMT[vtype], value)


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


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
    out = [b"GGUF", struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata))]
    for key, value, vtype in metadata:
        out += [_string(key), encode_value(value, vtype)]
    offsets, cursor = [], 0
    for t in tensors:
        offsets.append(cursor)
        out += [_string(t.name), struct.pack("<I", len(t.ne)), struct.pack(f"<{len(t.ne)}Q", *t.ne),
                struct.pack("<IQ", t.type_id, cursor)]
        cursor = _align(cursor + t.nbytes, alignment)
    header = b"".join(out)
    header += bytes(_align(len(header), alignment) - len(header))
    return GGUFLayout(header, tuple(offsets), len(header) + cursor)


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
                fh.write(bytes(_align(written, alignment) - written))
                if on_tensor is not None:
                    on_tensor(i, t)
            size = fh.tell()
        if size != lay.file_size:
            raise AssertionError(f"wrote {size} bytes, the layout planned {lay.file_size}")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return size
