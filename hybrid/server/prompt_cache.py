"""Prompt caching between requests (llama-server's cache_prompt and --cache-ram): the slot's KV cache is kept
after a request, and the next one reuses its longest common token prefix. When a request would overwrite a
cached conversation, that conversation's K/V rows are first copied to host RAM (bounded by --cache-ram bytes,
least recently used dropped first), so a client that comes back later gets its prefix restored instead of
recomputed. The live cache is contiguous (a slot of BatchScheduler) or paged (the -np 1 server's Engine.new_cache:
a pool of its own, rows found through the block table)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from hybrid.kv.cache import KVCache
from kernels_cpu.kv_cache import cache_rows

MIN_SAVE_TOKENS = 64  # shorter states are cheaper to recompute than to keep


def common_prefix(a: list[int], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


@dataclass
class SavedState:
    ids: tuple[int, ...]
    layers: list[tuple[np.ndarray, np.ndarray]]  # per layer: K and V rows [0, len(ids)) as host bytes

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


def _cells(layer, n: int):
    """Where positions [0, n) of a layer live: a slice of its rows (a contiguous cache), or the cells its block table
    gives (a paged cache, hybrid.kv.paged: Engine.new_cache's own pool), as an index of the layer's arrays."""
    if getattr(layer, "table", None) is None:
        return slice(0, n)
    cells = cache_rows(layer, np.arange(n, dtype=np.int64))
    if hasattr(layer.k, "get"):  # a GPU layer: the index on the device too
        import cupy  # noqa: PLC0415

        return cupy.asarray(cells)
    return cells


def _rows_to_host(arr, cells) -> np.ndarray:
    rows = arr[cells]
    return rows.get() if hasattr(rows, "get") else rows.copy()  # cupy arrays come back with .get()


def _rows_from_host(arr, cells, rows: np.ndarray) -> None:
    if hasattr(arr, "get"):
        import cupy  # noqa: PLC0415

        arr[cells] = cupy.asarray(rows)
    else:
        arr[cells] = rows


class PromptCache:
    """The slot's live KV cache with the token ids it holds, plus saved states in host RAM."""

    def __init__(self, cache: KVCache, ram_bytes: int):
        self.cache = cache
        self.ids: list[int] = []  # tokens whose K/V the live cache holds at positions 0..len-1
        self.ram_bytes = ram_bytes
        self.saved: OrderedDict[tuple[int, ...], SavedState] = OrderedDict()

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved.values())

    def prepare(self, ids: list[int], reuse: bool = True) -> int:
        """Make the live cache hold the longest cached prefix of `ids` (at most len(ids) - 1 tokens: the last
        one is evaluated for its logits) and return that length."""
        limit = len(ids) - 1
        live = common_prefix(ids, self.ids) if reuse else 0
        best, best_n = None, live
        if reuse:
            for key, state in self.saved.items():
                n = common_prefix(ids, key)
                if n > best_n:
                    best, best_n = state, n
        if live < len(self.ids):
            self._save_live()
        if best is not None and min(best_n, limit) > live:
            self._restore(best, min(best_n, limit))
            live = min(best_n, limit)
        n = min(live, limit)
        self.cache.n_past = n
        self.ids = list(ids[:n])
        return n

    def copy_from(self, other: "PromptCache", ids: list[int], n: int) -> int:
        """Make the live cache hold ids[:n] by copying K/V rows [0, n) from `other`'s live cache (another slot of
        the same engine, which holds those tokens at those positions: cell c = position c) on their device, instead
        of evaluating them again. Returns n."""
        for dst, src in zip(self.cache.layers, other.cache.layers, strict=True):
            dst.k[:n] = src.k[:n]
            if dst.v is not dst.k:  # MLA's one [latent | rope key] row is both
                dst.v[:n] = src.v[:n]
        self.cache.n_past = n
        self.ids = list(ids[:n])
        return n

    def finish(self, ids: list[int]) -> None:
        """After a generation: the prompt and reply tokens whose K/V the cache now holds."""
        self.ids = list(ids[: self.cache.n_past])

    def clear(self) -> None:
        self.cache.n_past = 0
        self.ids = []
        self.saved.clear()

    def _save_live(self) -> None:
        n = len(self.ids)
        if self.ram_bytes <= 0 or n < MIN_SAVE_TOKENS:
            return
        key = tuple(self.ids)
        if key in self.saved:
            self.saved.move_to_end(key)
            return
        for k in [k for k in self.saved if k[:n] == key]:  # a longer saved state holds this one: keep that
            self.saved.move_to_end(k)
            return
        for k in [k for k in self.saved if key[: len(k)] == k]:  # this one extends a saved state: replace it
            del self.saved[k]
        state = SavedState(key, [(_rows_to_host(layer.k, c), _rows_to_host(layer.v, c))
                                 for layer, c in ((layer, _cells(layer, n)) for layer in self.cache.layers)])
        if state.nbytes > self.ram_bytes:
            return
        self.saved[key] = state
        while self.saved_bytes > self.ram_bytes:
            self.saved.popitem(last=False)

    def _restore(self, state: SavedState, n: int) -> None:
        self.cache.reserve(n)  # a paged cache's blocks for the rows (a contiguous one has them)
        for layer, (k, v) in zip(self.cache.layers, state.layers):
            cells = _cells(layer, n)
            _rows_from_host(layer.k, cells, k[:n])
            if layer.v is not layer.k:  # MLA's one [latent | rope key] row is both
                _rows_from_host(layer.v, cells, v[:n])
        self.saved.move_to_end(state.ids)
