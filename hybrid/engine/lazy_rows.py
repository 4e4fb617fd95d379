"""LazyRows: the logits of a batch's positions, each computed when first read (Engine.eval_rows)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


class LazyRows:
    """rows[i] -> (n_vocab,) float32 logits of position i; compute(a, b) gives rows a..b-1 as (b - a, n_vocab), called
    for `chunk` rows from the first one not yet computed (a chunk of n: everything at the first read)."""

    def __init__(self, compute: Callable[[int, int], np.ndarray], n: int, chunk: int = 1):
        self._compute, self._n, self._chunk = compute, n, max(1, chunk)
        self._rows: list[np.ndarray] = []
        self.computed = 0  # rows computed so far (a test and the stats read it)
        self.ms = 0.0  # time spent computing them

    @classmethod
    def ready(cls, logits: np.ndarray) -> LazyRows:
        """Rows already computed: logits (n, n_vocab)."""
        rows = cls(lambda a, b: logits[a:b], logits.shape[0], logits.shape[0])
        rows._fill(rows._n)
        return rows

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"row {i} of {self._n}")
        if i >= len(self._rows):
            self._fill(i + 1)
        return self._rows[i]

    def _fill(self, upto: int) -> None:
        while len(self._rows) < upto:
            a = len(self._rows)
            b = min(self._n, max(upto, a + self._chunk))
            t0 = time.perf_counter()
            block = self._compute(a, b)
            self.ms += 1000 * (time.perf_counter() - t0)
            self._rows.extend(block[j] for j in range(b - a))
            self.computed = len(self._rows)
