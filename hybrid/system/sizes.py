"""Byte sizes as people write them ("24GiB", "512 MiB", "1.5G", "8000000000") and back ("23.1 GiB").

Units follow GNU coreutils: a bare letter or an `i` suffix is binary (K = Ki = KiB = 1024), a `B` after
an SI letter is decimal (KB = 1000, GB = 10**9). Case-insensitive; "B" alone or no unit means bytes.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from gguf_io.errors import HybridError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_SIZE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


class InvalidSize(HybridError, ValueError):
    """A size string that is not a non-negative number of bytes with an optional unit."""


def parse_size(text: str | int) -> int:
    """Bytes of a size: '24GiB' -> 25769803776, '1.5G' -> 1610612736, '8GB' -> 8000000000, '4096' -> 4096.

    Fractions of a byte are rounded down. Raises InvalidSize (a ValueError) naming the accepted forms.
    """
    if isinstance(text, bool):
        raise InvalidSize(f"size must be a number of bytes or a string like '24GiB', found {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise InvalidSize(f"size must be >= 0 bytes, found {text}")
        return text
    if not isinstance(text, str):
        raise InvalidSize(f"size must be a number of bytes or a string like '24GiB', found {type(text).__name__}")
    m = _SIZE.match(text)
    if m is None:
        raise InvalidSize(
            f"invalid size {text!r}: expected a non-negative number with an optional unit, "
            "e.g. 8000000000, 512MiB, 24GiB, 1.5G (binary) or 8GB (decimal)"
        )
    number, prefix, binary, b = m.groups()
    prefix = prefix.lower()
    if binary and not prefix:
        raise InvalidSize(f"invalid size {text!r}: 'i' needs a unit letter before it (KiB, MiB, GiB, TiB)")
    try:
        value = Decimal(number.replace("_", ""))
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal literals
        raise InvalidSize(f"invalid size {text!r}: {number!r} is not a number") from None
    decimal_si = bool(prefix) and bool(b) and not binary  # "GB": powers of 1000
    base = 1000 if decimal_si else 1024
    return int(value * base ** _PREFIX[prefix])


def format_size(n: int, precision: int = 1) -> str:
    """'23.1 GiB' for 24803434086 (binary units); plain bytes below 1 KiB ('512 B')."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < KiB:
        return f"{sign}{n} B"
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{sign}{value:.{precision}f} {_UNITS[unit]}"


def format_pair(a: int, b: int) -> tuple[str, str]:
    """Two sizes formatted with enough digits that different values never read the same ('22.04', '22.00')."""
    for precision in (1, 2, 3):
        fa, fb = format_size(a, precision), format_size(b, precision)
        if fa != fb or a == b:
            return fa, fb
    return fa, fb
