"""The KV side of a ragged batch: several sequences' rows stacked into one batch, each sequence with its own cache.

Rows [start, end) of the stacked batch belong to the sequence whose KV cache is `cache` (one KVCache per slot,
contiguous storage, as llama-server's slots). attention_block stores and attends per sequence through `seqs`;
everything else in a layer runs once over the stacked rows. A paged cache would carry block tables here instead,
read by a backend's attention over the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybrid.kv.cache import KVCache


@dataclass(frozen=True)
class SeqRows:
    cache: KVCache
    start: int  # first row of this sequence in the stacked batch
    end: int


@dataclass(frozen=True)
class KVBatch:
    seqs: tuple[SeqRows, ...]

    @classmethod
    def of(cls, caches: Sequence[KVCache], lengths: Sequence[int]) -> "KVBatch":
        """Sequence i: lengths[i] consecutive rows, in caches[i]."""
        seqs, start = [], 0
        for cache, n in zip(caches, lengths, strict=True):
            seqs.append(SeqRows(cache, start, start + n))
            start += n
        return cls(tuple(seqs))

    @property
    def n_rows(self) -> int:
        return self.seqs[-1].end if self.seqs else 0
