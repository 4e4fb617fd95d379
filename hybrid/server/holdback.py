"""Streaming text filters that hold back what is not resolved yet: a partial stop string (never leaked); the
helper that finds how much of a text's end could still become a tag is text.stream.partial_tail."""

from __future__ import annotations

from hybrid.text.stream import partial_tail


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
