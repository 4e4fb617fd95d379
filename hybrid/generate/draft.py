"""Drafters for speculative decoding: `propose(tokens) -> draft` guesses the tokens that follow a sequence.

NgramDrafter is prompt lookup (llama.cpp's `--spec-type ngram`): the last n tokens are looked up earlier in the
sequence (prompt and generated) and the tokens that followed their most recent occurrence are proposed.
ModelDrafter (draft_model.py) asks a smaller model with the same vocabulary (`-md`); a drafter with state may also
have `prefill(tokens)`, which generate_speculative calls with the prompt during the prompt's evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class Drafter(Protocol):
    def propose(self, tokens: list[int], n_max: int) -> list[int]:
        """At most n_max drafted tokens to follow `tokens` (the whole sequence so far: what the target's cache
        holds and the token about to be evaluated); [] when there is no guess."""
        ...


@dataclass
class NgramDrafter:
    """Suffix match of length n (then n-1 … 2; just 1 when n is 1), most recent earlier occurrence first;
    proposes up to draft_max of the tokens that followed it, nothing when fewer than draft_min follow."""

    n: int = 3  # --spec-ngram-n
    draft_max: int = 8  # --draft-max
    draft_min: int = 1  # --draft-min

    def __post_init__(self):
        if self.n < 1 or self.draft_max < 1 or not 0 <= self.draft_min <= self.draft_max:
            raise ValueError(f"need n >= 1 and 0 <= draft_min <= draft_max >= 1, got n={self.n}, "
                             f"draft_min={self.draft_min}, draft_max={self.draft_max}")

    def propose(self, tokens: list[int], n_max: int | None = None) -> list[int]:
        n_max = self.draft_max if n_max is None else min(n_max, self.draft_max)
        if n_max < max(self.draft_min, 1):
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for size in (range(self.n, 1, -1) if self.n > 1 else (1,)):
            at = _last_occurrence(seq, size)
            if at < 0:
                continue
            draft = seq[at + size : at + size + n_max]
            return [int(t) for t in draft] if len(draft) >= max(self.draft_min, 1) else []
        return []


def _last_occurrence(seq: np.ndarray, size: int) -> int:
    """Start of the most recent occurrence of seq[-size:] that ends before the last token, or -1."""
    if len(seq) <= size:
        return -1
    head = seq[:-1]  # an occurrence must end before the suffix does, so at least one token follows it
    cand = np.flatnonzero(head[size - 1 :] == seq[-1])  # windows whose last token matches: cheap first filter
    if cand.size == 0:
        return -1
    if size > 1:
        windows = sliding_window_view(head, size)[cand]  # (n_cand, size)
        cand = cand[np.all(windows == seq[-size:], axis=1)]
    return int(cand[-1]) if cand.size else -1
