"""Codepoint classes as llama.cpp's unicode tables define them, and GPT-2's byte <-> unicode mapping.

llama.cpp generates its tables from Unicode 15.1 (`unicode-data.cpp`); Python 3.11's `unicodedata` is
Unicode 14.0, so the characters first assigned in 15.0/15.1 are listed below by hand (UCD facts).
On a Python whose unicodedata is newer than 15.1 (3.14+), characters assigned after 15.1 get a class
here but stay "undefined" in llama.cpp; no real text in the fixtures touches them.
"""

from __future__ import annotations

import unicodedata

# Flag bits, as llama.cpp's `unicode_cpt_flags` (unicode.h).
UNDEFINED = 0x0001
NUMBER = 0x0002  # \p{N}
LETTER = 0x0004  # \p{L}
SEPARATOR = 0x0008  # \p{Z}
ACCENT_MARK = 0x0010  # \p{M}
PUNCTUATION = 0x0020  # \p{P}
SYMBOL = 0x0040  # \p{S}
CONTROL = 0x0080  # \p{C}
WHITESPACE = 0x0100  # \s (the Unicode White_Space property)

_CATEGORY_FLAG = {
    "Cn": UNDEFINED, "Cc": CONTROL, "Cf": CONTROL, "Co": CONTROL, "Cs": CONTROL,
    "Ll": LETTER, "Lm": LETTER, "Lo": LETTER, "Lt": LETTER, "Lu": LETTER,
    "Mc": ACCENT_MARK, "Me": ACCENT_MARK, "Mn": ACCENT_MARK,
    "Nd": NUMBER, "Nl": NUMBER, "No": NUMBER,
    "Pc": PUNCTUATION, "Pd": PUNCTUATION, "Pe": PUNCTUATION, "Pf": PUNCTUATION,
    "Pi": PUNCTUATION, "Po": PUNCTUATION, "Ps": PUNCTUATION,
    "Sc": SYMBOL, "Sk": SYMBOL, "Sm": SYMBOL, "So": SYMBOL,
    "Zl": SEPARATOR, "Zp": SEPARATOR, "Zs": SEPARATOR,
}

# Unicode White_Space (PropList.txt).
WHITESPACE_CPTS = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)

# Characters assigned in Unicode 15.0 and 15.1: (first, last, general category class).
_UNICODE_15_ADDITIONS = (
    (0x00CF3, 0x00CF3, "M"), (0x00ECE, 0x00ECE, "M"), (0x02FFC, 0x02FFF, "S"), (0x031EF, 0x031EF, "S"),
    (0x10EFD, 0x10EFF, "M"), (0x1123F, 0x11240, "L"), (0x11241, 0x11241, "M"), (0x11B00, 0x11B09, "P"),
    (0x11F00, 0x11F01, "M"), (0x11F02, 0x11F02, "L"), (0x11F03, 0x11F03, "M"), (0x11F04, 0x11F10, "L"),
    (0x11F12, 0x11F33, "L"), (0x11F34, 0x11F3A, "M"), (0x11F3E, 0x11F42, "M"), (0x11F43, 0x11F4F, "P"),
    (0x11F50, 0x11F59, "N"), (0x1342F, 0x1342F, "L"), (0x13439, 0x1343F, "C"), (0x13440, 0x13440, "M"),
    (0x13441, 0x13446, "L"), (0x13447, 0x13455, "M"), (0x1B132, 0x1B132, "L"), (0x1B155, 0x1B155, "L"),
    (0x1D2C0, 0x1D2D3, "N"), (0x1DF25, 0x1DF2A, "L"), (0x1E030, 0x1E06D, "L"), (0x1E08F, 0x1E08F, "M"),
    (0x1E4D0, 0x1E4EB, "L"), (0x1E4EC, 0x1E4EF, "M"), (0x1E4F0, 0x1E4F9, "N"), (0x1F6DC, 0x1F6DC, "S"),
    (0x1F774, 0x1F776, "S"), (0x1F77B, 0x1F77F, "S"), (0x1F7D9, 0x1F7D9, "S"), (0x1FA75, 0x1FA77, "S"),
    (0x1FA87, 0x1FA88, "S"), (0x1FAAD, 0x1FAAF, "S"), (0x1FABB, 0x1FABD, "S"), (0x1FABF, 0x1FABF, "S"),
    (0x1FACE, 0x1FACF, "S"), (0x1FADA, 0x1FADB, "S"), (0x1FAE8, 0x1FAE8, "S"), (0x1FAF7, 0x1FAF8, "S"),
    (0x2B739, 0x2B739, "L"), (0x2EBF0, 0x2EE5D, "L"), (0x31350, 0x323AF, "L"),
)
_CLASS_FLAG = {"L": LETTER, "M": ACCENT_MARK, "N": NUMBER, "P": PUNCTUATION, "S": SYMBOL, "C": CONTROL}

_flags_cache: dict[int, int] = {}


def _compute_flags(cpt: int) -> int:
    flags = _CATEGORY_FLAG[unicodedata.category(chr(cpt))]
    if flags == UNDEFINED:
        for first, last, cls in _UNICODE_15_ADDITIONS:
            if first <= cpt <= last:
                flags = _CLASS_FLAG[cls]
                break
    if cpt in WHITESPACE_CPTS:
        flags |= WHITESPACE
    return flags


def cpt_flags(cpt: int) -> int:
    """llama.cpp's `unicode_cpt_flags_from_cpt(cpt).as_uint()` (category bit | WHITESPACE)."""
    f = _flags_cache.get(cpt)
    if f is None:
        f = _flags_cache[cpt] = _compute_flags(cpt)
    return f


def text_flags(cpts: list[int]) -> list[int]:
    """cpt_flags for every codepoint of a text, one list."""
    cache = _flags_cache
    out = []
    append = out.append
    for c in cpts:
        f = cache.get(c)
        if f is None:
            f = cache[c] = _compute_flags(c)
        append(f)
    return out


def _gpt2_byte_chars() -> list[str]:
    # GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the rest to U+0100 onwards.
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = [""] * 256
    n = 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


BYTE_TO_CHAR: list[str] = _gpt2_byte_chars()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# str.translate table: Latin-1 text (one char per byte) -> GPT-2 byte-level characters.
LATIN1_TO_BYTE_CHARS = {b: c for b, c in enumerate(BYTE_TO_CHAR)}


def byte_encode(word: str) -> str:
    """GPT-2 byte-level encoding of a word: its UTF-8 bytes, each as one printable character."""
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(LATIN1_TO_BYTE_CHARS)
