"""Token ids -> bytes/text, as llama.cpp's token_to_piece and llama_detokenize.

Pieces are bytes: a byte token (<0xXX>) is one byte, and a character split over several tokens only
becomes text once the bytes are joined, so text is decoded (errors='replace') after joining.
"""

from __future__ import annotations

import re

from hybrid.text.tokenizer.unicode import CHAR_TO_BYTE
from hybrid.text.tokenizer.vocab import ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED, Vocab

_SPECIAL = ATTR_UNKNOWN | ATTR_CONTROL


def _utf8(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def _bpe_decode_text(text: str) -> bytes:
    """GPT-2 byte-level characters -> bytes (llama_decode_text)."""
    out = bytearray()
    for ch in text:
        b = CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + _utf8(ch).hex().encode() + _utf8(text) + b"]"
    return bytes(out)


def render_piece(vocab: Vocab, tid: int) -> bytes:
    """The piece of a token as llama.cpp caches it (special tokens rendered)."""
    attr = vocab.attrs[tid]
    text = vocab.tokens[tid]
    if attr & (_SPECIAL | ATTR_USER_DEFINED):
        return _utf8(text)
    if attr & ATTR_NORMAL:
        if vocab.kind == "spm" or vocab.escape_whitespaces:
            return _utf8(text.replace("\u2581", " "))
        return _bpe_decode_text(text)
    if attr & ATTR_BYTE:
        return bytes([int(text[3:5], 16)])
    return b""  # UNUSED / UNDEFINED tokens render as nothing


class PieceCache:
    """token_to_piece with a lazily filled cache of the rendered pieces."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._cache: dict[int, bytes] = {}

    def piece(self, tid: int, special: bool = True, lstrip: bool = False) -> bytes:
        if not special and self.vocab.attrs[tid] & _SPECIAL:
            return b""
        p = self._cache.get(tid)
        if p is None:
            p = self._cache[tid] = render_piece(self.vocab, tid)
        if lstrip and p[:1] == b" ":
            p = p[1:]
        return p

    def detokenize(self, ids, remove_special: bool = False, unparse_special: bool = False) -> bytes:
        v = self.vocab
        ids = list(ids)
        remove_space = v.add_space_prefix
        if remove_special and v.add_bos and ids and ids[0] == v.bos:
            remove_space = False
            ids = ids[1:]
        if remove_special and v.add_eos and ids and ids[-1] == v.eos:
            ids = ids[:-1]
        parts = []
        for tid in ids:
            parts.append(self.piece(tid, unparse_special, remove_space))
            remove_space = False
        text = b"".join(parts)
        return clean_spaces(text) if v.clean_spaces else text


# clean_spaces' three passes (llama.cpp's loops): each removes one space, decided by the bytes around it
_SPACE_BEFORE_PUNCT = re.compile(rb" (?=[?!.,])")
_SPACED_QUOTE = re.compile(rb" ' ")  # left to right, not overlapping: the space after a match starts no other
_SPACE_BEFORE_CONTRACTION = re.compile(rb" (?='(?:[sm]|re|ve))")


def clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces: " ?", " !", " .", " ," lose their space; then " ' " becomes "'";
    then " 's", " 'm", " 're", " 've" lose their space."""
    text = _SPACE_BEFORE_PUNCT.sub(b"", text)
    text = _SPACED_QUOTE.sub(b"'", text)
    return _SPACE_BEFORE_CONTRACTION.sub(b"", text)
