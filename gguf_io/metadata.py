"""Bounds-checked reading of a GGUF header: scalars, strings and the typed key/value section.

Every read checks the bytes it needs against the end of the file first, so a damaged or hostile
file raises `GGUFFormatError` (one line, with offsets) and never an IndexError, struct.error,
UnicodeDecodeError or an allocation sized by an unchecked count.
"""

from __future__ import annotations

import struct

import numpy as np

from .errors import GGUFFormatError

# GGUF metadata value types (gguf.h `enum gguf_type`).
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
VALUE_TYPE_NAMES = ("u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64")
_SCALAR_DTYPES: dict[int, np.dtype] = {
    U8: np.dtype("u1"), I8: np.dtype("i1"), U16: np.dtype("<u2"), I16: np.dtype("<i2"),
    U32: np.dtype("<u4"), I32: np.dtype("<i4"), F32: np.dtype("<f4"), BOOL: np.dtype("u1"),
    U64: np.dtype("<u8"), I64: np.dtype("<i8"), F64: np.dtype("<f8"),
}
_STRUCTS = {t: struct.Struct("<" + c) for t, c in zip(_SCALAR_DTYPES, "BbHhIifBQqd")}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# The smallest possible encoding of one key/value pair: key length (8) + value type (4) + a 1-byte value.
MIN_KV_BYTES = 8 + 4 + 1


def type_name(vtype: int) -> str:
    return VALUE_TYPE_NAMES[vtype] if 0 <= vtype < len(VALUE_TYPE_NAMES) else f"unknown type {vtype}"


def describe(value) -> str:
    """A short one-line description of a metadata value, for error messages."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.size} {value.dtype}"
    if isinstance(value, list):
        return f"an array of {len(value)} strings"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


class Cursor:
    """A read position in `buf` (a bytes-like view of the whole file) that never reads past `size`."""

    __slots__ = ("buf", "pos", "size", "where")

    def __init__(self, buf, size: int, pos: int, where: str):
        self.buf, self.size, self.pos, self.where = buf, size, pos, where

    def fail(self, msg: str) -> GGUFFormatError:
        return GGUFFormatError(f"{self.where}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated: reading {what} needs {n} bytes at offset {self.pos}, "
                f"but the file ends at {self.size} ({self.size - self.pos} bytes left)"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str) -> bytes:
        start = self.pos
        n = self.u64(f"the length of {what}")
        if n > self.size - self.pos:
            raise self.fail(
                f"{what} at offset {start} claims {n} bytes, but only {self.size - self.pos} bytes remain in the file"
            )
        b = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return b

    def strict_string(self, what: str) -> str:
        """A string that must be valid UTF-8 (keys, tensor names)."""
        start = self.pos
        b = self.raw_string(what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(
                f"{what} at offset {start} is not valid UTF-8 (byte {exc.start}: {b[:40]!r})"
            ) from None

    def value(self, vtype: int, what: str):
        """One metadata value of type `vtype`, as documented in docs/CONTRACTS.md."""
        if vtype == STRING:
            return self._value_string(what)
        if vtype == ARRAY:
            return self._array(what)
        st = _STRUCTS.get(vtype)
        if st is None:
            raise self.fail(f"{what}: unknown value type {vtype} at offset {self.pos - 4} (expected 0..12)")
        self.need(st.size, what)
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        if vtype == BOOL:
            return v != 0
        return float(v) if vtype in (F32, F64) else int(v)

    def _value_string(self, what: str) -> str:
        # Values are decoded losslessly: bytes that are not UTF-8 survive as surrogates (surrogateescape).
        return str(self.raw_string(what), "utf-8", "surrogateescape")

    def _array(self, what: str):
        start = self.pos
        etype = self.u32(f"the element type of array {what}")
        count = self.u64(f"the length of array {what}")
        left = self.size - self.pos
        if etype == STRING:
            if count > left // 8:  # every string needs at least its 8-byte length
                raise self.fail(
                    f"string array {what} at offset {start} claims {count} elements, "
                    f"at least {count * 8} bytes, but only {left} bytes remain in the file"
                )
            return self._string_array(count, what)
        if etype == ARRAY:
            raise self.fail(f"array {what} at offset {start} holds arrays; nested arrays are not supported")
        dt = _SCALAR_DTYPES.get(etype)
        if dt is None:
            raise self.fail(f"array {what} at offset {start}: unknown element type {etype} (expected 0..12)")
        if count > left // dt.itemsize:
            raise self.fail(
                f"{type_name(etype)} array {what} at offset {start} claims {count} elements "
                f"({count * dt.itemsize} bytes), but only {left} bytes remain in the file"
            )
        arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
        self.pos += count * dt.itemsize
        if etype == BOOL:
            return arr != 0
        return arr.astype(dt.newbyteorder("="), copy=False)

    def _string_array(self, count: int, what: str) -> list[str]:
        # The hot loop of the header (262144 tokens for Gemma): locals only, a message built only on failure.
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"the length of element {i} of {what}")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                raise self.fail(
                    f"element {i} of string array {what} at offset {pos - 8} claims {n} bytes, "
                    f"but only {size - pos} bytes remain in the file"
                )
            append(str(buf[pos : pos + n], "utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out


def read_metadata(cur: Cursor, n_kv: int) -> tuple[dict, dict]:
    """The `n_kv` key/value pairs at the cursor -> (metadata, metadata_types) in file order.

    metadata_types maps a key to its GGUF value type, and (ARRAY, element type) for arrays.
    """
    metadata: dict = {}
    types: dict = {}
    for i in range(n_kv):
        start = cur.pos
        key = cur.strict_string(f"the key of metadata pair #{i}")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r} at offset {start} (pair #{i})")
        vtype = cur.u32(f"the value type of {key!r}")
        if vtype == ARRAY and cur.size - cur.pos >= 4:
            (etype,) = _U32.unpack_from(cur.buf, cur.pos)
            types[key] = (ARRAY, etype)
        else:
            types[key] = vtype
        metadata[key] = cur.value(vtype, f"{key!r}")
    return metadata, types
