"""Incremental detokenization: emit only complete UTF-8 text as tokens arrive (a character may span tokens)."""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        """The new text that token_id completes ("" while a multi-byte character is still partial)."""
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        new = text[len(self.emitted):]
        self.emitted = text
        return new

    def flush(self) -> str:
        text = self.tok.decode(self.ids)
        new = text[len(self.emitted):]
        self.emitted = text
        return new
