"""The validated, memory-mapped GGUF reader: header, typed metadata and tensor table; tensors are zero-copy views.

GGUF v2/v3, little-endian: magic, u32 version, u64 n_tensors, u64 n_kv, the key/value pairs, the tensor
infos, padding to `general.alignment`, then the data section. Anything a damaged file gets wrong raises
`GGUFFormatError` with one line saying what was expected and what was found.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import GGUFFormatError, HybridError
from .ggml_types import GGML_TYPES, PLAIN_DTYPES
from .metadata import MIN_KV_BYTES, Cursor, describe, read_metadata

GGUF_MAGIC = b"GGUF"
HEADER_BYTES = 4 + 4 + 8 + 8
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# The smallest tensor info: name length (8) + n_dims (4) + one ne (8) + type (4) + offset (8).
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. `ne` is in ggml order (row width first), `shape` in numpy order."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    n_elements: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (ne[0] elements)."""
        bs, ts = GGML_TYPES[self.ggml_type][1:]
        return self.ne[0] // bs * ts


class GGUFFile:
    """An open GGUF file (see docs/CONTRACTS.md). `GGUFFile(path)` maps and validates; use as a context manager.

    use_mmap=False (--no-mmap) reads the whole file into anonymous memory instead; `.mmap` is then a read-only
    uint8 array, not a mapping, and tensor views point into it."""

    def __init__(self, path: str | os.PathLike, use_mmap: bool = True):
        self.path = Path(path)
        where = str(self.path)
        self.file_size = os.stat(self.path).st_size  # OSError (missing file) propagates unchanged
        if self.file_size < 4:
            raise GGUFFormatError(f"{where}: file too small: {self.file_size} bytes, not a GGUF file (no magic)")
        self.mmap: np.ndarray | None = (np.memmap(self.path, dtype=np.uint8, mode="r") if use_mmap
                                        else _read_file(self.path, self.file_size))
        self.file_size = int(self.mmap.size)
        buf = memoryview(self.mmap)
        try:
            self._parse(buf, where)
        finally:
            buf.release()

    # -- parsing ---------------------------------------------------------------------------------------------
    def _parse(self, buf: memoryview, where: str) -> None:
        size = self.file_size
        magic = bytes(buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(f"{where}: bad magic: expected b'GGUF' at offset 0, found {magic!r}")
        if size < HEADER_BYTES:
            raise GGUFFormatError(f"{where}: file too small: {size} bytes, a GGUF header needs at least {HEADER_BYTES}")
        cur = Cursor(buf, size, 4, where)
        self.version = cur.u32("the version")
        if self.version not in (2, 3):
            hint = " (a big-endian file?)" if self.version & 0xFFFF == 0 else ""
            raise GGUFFormatError(f"{where}: unsupported GGUF version {self.version}{hint}: expected 2 or 3")
        n_tensors = cur.u64("the tensor count")
        n_kv = cur.u64("the metadata count")
        left = size - HEADER_BYTES
        if n_kv > left // MIN_KV_BYTES or n_tensors > left // MIN_TENSOR_INFO_BYTES or (
            n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES > left
        ):
            raise GGUFFormatError(
                f"{where}: impossible counts: {n_tensors} tensors and {n_kv} metadata pairs need at least "
                f"{n_tensors * MIN_TENSOR_INFO_BYTES + n_kv * MIN_KV_BYTES} bytes after the header, the file has {left}"
            )
        self.metadata, self.metadata_types = read_metadata(cur, n_kv)
        self.alignment = self._read_alignment(where)
        infos = [self._read_tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, gtype, rel, start in infos:
            if name in self.tensors:
                raise GGUFFormatError(f"{where}: duplicate tensor name {name!r} (tensor info at offset {start})")
            self.tensors[name] = self._tensor(where, name, ne, gtype, rel)
        self._check_overlaps(where)

    def _read_alignment(self, where: str) -> int:
        a = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(a, int) or isinstance(a, bool):
            raise GGUFFormatError(f"{where}: general.alignment must be an integer, found {describe(a)}")
        if a <= 0 or a & (a - 1):
            raise GGUFFormatError(f"{where}: general.alignment must be a power of two, found {a}")
        return a

    def _read_tensor_info(self, cur: Cursor, i: int):
        start = cur.pos
        name = cur.strict_string(f"the name of tensor #{i}")
        n_dims = cur.u32(f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} (info at offset {start}): n_dims must be 1..{MAX_DIMS}, found {n_dims}")
        ne = tuple(cur.u64(f"ne[{d}] of tensor {name!r}") for d in range(n_dims))
        gtype = cur.u32(f"the type of tensor {name!r}")
        rel = cur.u64(f"the data offset of tensor {name!r}")
        return name, ne, gtype, rel, start

    def _tensor(self, where: str, name: str, ne: tuple[int, ...], gtype: int, rel: int) -> TensorInfo:
        if any(n == 0 or n > _INT64_MAX for n in ne):  # ne is int64 in ggml: > INT64_MAX is negative there
            shown = [n if n <= _INT64_MAX else n - 2**64 for n in ne]
            raise GGUFFormatError(f"{where}: tensor {name!r}: every ne must be >= 1, found ne={shown}")
        n_elements = 1
        for n in ne:
            n_elements *= n
        if n_elements > _INT64_MAX:
            raise GGUFFormatError(f"{where}: tensor {name!r}: element count overflows int64 (ne={list(ne)})")
        t = GGML_TYPES.get(gtype)
        if t is None:
            raise GGUFFormatError(f"{where}: tensor {name!r}: unknown GGML type id {gtype}")
        if ne[0] % t.block_size:
            raise GGUFFormatError(
                f"{where}: tensor {name!r} ({t.name}): row width ne[0]={ne[0]} is not a multiple of "
                f"the block size {t.block_size}"
            )
        if rel % self.alignment:
            raise GGUFFormatError(
                f"{where}: tensor {name!r}: data offset {rel} is not a multiple of the alignment {self.alignment}"
            )
        nbytes = n_elements // t.block_size * t.type_size
        offset = self.data_offset + rel
        if offset + nbytes > self.file_size:
            raise GGUFFormatError(
                f"{where}: tensor {name!r} ({t.name}, ne={list(ne)}): data [{offset}, {offset + nbytes}) "
                f"runs past the end of the file ({self.file_size} bytes)"
            )
        return TensorInfo(name, ne, gtype, t.name, offset, nbytes, n_elements)

    def _check_overlaps(self, where: str) -> None:
        prev = None
        for t in sorted(self.tensors.values(), key=lambda t: t.offset):
            if prev is not None and t.offset < prev.offset + prev.nbytes:
                raise GGUFFormatError(
                    f"{where}: tensors overlap: {prev.name!r} occupies [{prev.offset}, {prev.offset + prev.nbytes}) "
                    f"and {t.name!r} starts at {t.offset}"
                )
            prev = t

    # -- public API ------------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            found = "missing" if arch is None else f"a {type(arch).__name__}"
            raise GGUFFormatError(f"{self.path}: metadata key 'general.architecture' (a string) is {found}")
        return arch

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())

    def tensor_bytes_by_type(self) -> dict[str, int]:
        """Total data bytes per GGML type name, largest first."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.type_name] = out.get(t.type_name, 0) + t.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def tensor_info(self, name: str) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            close = difflib.get_close_matches(name, self.tensors, n=3)
            hint = f"; similar: {', '.join(close)}" if close else ""
            raise GGUFFormatError(f"{self.path}: no tensor named {name!r} ({len(self.tensors)} tensors){hint}")
        return t

    def tensor_data(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of a tensor's data.

        Plain types: shape `TensorInfo.shape` with their dtype (F32 float32, F16 float16, BF16 uint16, ...);
        quantized types: uint8 of shape `shape[:-1] + (row_bytes,)`, the raw blocks of each row.
        """
        t = self.tensor_info(name)
        if self.mmap is None:
            raise HybridError(f"{self.path}: the file is closed")
        dtype = PLAIN_DTYPES.get(t.type_name)
        if dtype is not None:
            shape = t.shape
        else:
            dtype, shape = np.dtype(np.uint8), t.shape[:-1] + (t.row_bytes,)
        return np.ndarray(shape, dtype=dtype, buffer=self.mmap, offset=t.offset)

    def close(self) -> None:
        """Drop this object's reference to the mapping; views already handed out stay valid (they keep it alive)."""
        self.mmap = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"
        )


def _read_file(path: Path, size: int) -> np.ndarray:
    """The file's bytes in anonymous memory (read-only array), read in chunks (one read(2) returns at most ~2 GiB)."""
    buf = np.empty(size, dtype=np.uint8)
    view, pos = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while pos < size:
            n = f.readinto(view[pos : pos + (1 << 28)])
            if not n:
                raise GGUFFormatError(f"{path}: the file shrank while it was read: {pos} of {size} bytes")
            pos += n
    view.release()
    buf.flags.writeable = False
    return buf


def open_gguf(path: str | os.PathLike, use_mmap: bool = True) -> GGUFFile:
    """Memory-map a GGUF file read-only (or, use_mmap=False, read it into memory) and validate it
    (GGUFFormatError on any damage)."""
    return GGUFFile(path, use_mmap)
