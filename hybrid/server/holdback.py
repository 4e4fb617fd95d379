"""Streaming text filters that hold back what is not resolved yet: a partial stop string (never leaked), and the
shared helper that finds how much of a text's end could still become a tag."""

from __future__ import annotations


def partial_tail(text: str, tags: tuple[str, ...] | list[str]) -> int:
    """The length of the longest end of `text` that is a proper beginning of one of `tags` (0 if none)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class StopStrings:
    """Cuts generated text at the first stop string; push() returns the text that is safe to emit."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        keep = partial_tail(self.pending, self.stops)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The end of the generation: what was held back was not a stop string after all."""
        out, self.pending = self.pending, ""
        return out
