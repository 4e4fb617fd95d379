"""Scanning JSON that is still being generated: where a value ends (None while it is incomplete) and the fields of
an object seen so far, with the span of each value's raw text. Enough to stream tool calls as they are written."""

from __future__ import annotations

import json

WS = " \t\r\n"


class Malformed(ValueError):
    """The text cannot be the beginning of a JSON value."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """`text[i]` is '"': the index after the closing quote, or None if the string is not closed yet."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at `text[i]`, or None if it is not complete yet."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    if c in "-0123456789tfn":  # a number or a literal ends at a delimiter; at the end of the text it may go on
        j = i
        while j < len(text) and text[j] not in WS + ",}]":
            j += 1
        return j if j < len(text) else None
    raise Malformed(f"no JSON value can start with {c!r}")


def object_fields(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """`text[i]` is '{': ({key: (value start, value end or None)} of the fields seen so far, the index after the
    closing brace or None). Raises Malformed when the text cannot continue into an object."""
    fields: dict[str, tuple[int, int | None]] = {}
    i = skip_ws(text, i + 1)
    if i < len(text) and text[i] == "}":
        return fields, i + 1
    while i < len(text):
        if text[i] != '"':
            raise Malformed(f"expected a key at offset {i}, found {text[i]!r}")
        k_end = string_end(text, i)
        if k_end is None:
            return fields, None
        key = json.loads(text[i:k_end])
        i = skip_ws(text, k_end)
        if i >= len(text):
            return fields, None
        if text[i] != ":":
            raise Malformed(f"expected ':' at offset {i}, found {text[i]!r}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return fields, None
        end = value_end(text, i)
        fields[key] = (i, end)
        if end is None:
            return fields, None
        i = skip_ws(text, end)
        if i >= len(text):
            return fields, None
        if text[i] == "}":
            return fields, i + 1
        if text[i] != ",":
            raise Malformed(f"expected ',' or '}}' at offset {i}, found {text[i]!r}")
        i = skip_ws(text, i + 1)
    return fields, None
