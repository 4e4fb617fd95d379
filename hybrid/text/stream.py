"""Incremental detokenization: emit only complete UTF-8 text as tokens arrive (a character may span tokens)."""

from __future__ import annotations


class TextStream:
    """special=False (llama.cpp's default) renders control tokens as nothing; True (--special) prints them."""

    def __init__(self, tokenizer, special: bool = False):
        self.tok = tokenizer
        self.special = special
        self.ids: list[int] = []
        self.emitted = ""
        self._bytes = bytearray()  # the pieces of ids, joined (Tokenizer.decode_piece), before clean_text

    def push(self, token_id: int) -> str:
        """The new text that token_id completes ("" while a multi-byte character is still partial)."""
        self._bytes += self.tok.decode_piece(token_id, not self.ids, self.special)
        self.ids.append(token_id)
        text = self.tok.clean_text(bytes(self._bytes)).decode("utf-8", "replace")  # = decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        new = text[len(self.emitted):]
        self.emitted = text
        return new

    def flush(self) -> str:
        text = self.tok.decode(self.ids, unparse_special=self.special)
        new = text[len(self.emitted):]
        self.emitted = text
        return new


def partial_tail(text: str, tags: tuple[str, ...] | list[str]) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `tags` (0 if none)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
