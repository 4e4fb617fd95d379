"""The host bookkeeping of the runtime expert cache (runtime.py): per layer, which expert each slot holds and the
policy's state, one decode step at a time; uploads waiting for their copies; the hit and upload counts. No GPU here.

`LayerSlots` is policy.SlotPool for one layer and one step at a time, with the same decisions (the same victims,
the same ties: tests/test_moe_cache_book.py replays both), at ~7 us a step plus ~7 an eviction instead of ~150
(measured on the 2-core dev machine): it runs in every layer of every token, inside the host break of the decode
step. A slot's table entry on the device is written by the runtime: -1 as soon as its expert is evicted (before the
copy over it starts), the slot only once the copy is done (`CacheBook.settle`); `gen` tells a finished copy from one
whose slot was taken again since.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from hybrid.backends.moe_cache.policy import check_slots

_NEVER = np.iinfo(np.int64).max


class LayerSlots:
    """One layer's n_slots slots over n_expert experts under `policy` (policy.py), at most max_inserts uploads a
    step (None: no cap)."""

    def __init__(self, n_expert: int, top_k: int, n_slots: int, policy: str = "lru",
                 max_inserts: int | None = None) -> None:
        check_slots(n_expert, top_k, n_slots, policy)
        self.policy, self.n_slots = policy, n_slots
        self.cap = top_k if max_inserts is None else min(top_k, max_inserts)
        self.slot_of = np.full(n_expert, -1, dtype=np.int32)
        self.expert_in = np.full(n_slots, -1, dtype=np.int64)
        self.gen = np.zeros(n_slots, dtype=np.int64)  # inserts into each slot so far
        self.last = np.full(n_expert, -1, dtype=np.int64)
        self.freq = np.zeros(n_expert, dtype=np.int64)
        self.clock = 0
        self._free = list(range(n_slots))  # ascending: the lowest free slot first, as SlotPool

    def step(self, ids: np.ndarray, admit: bool = True) -> list[tuple[int, int, int]]:
        """One step of routed experts ids (k,) int, distinct, in routing order -> the uploads it decides:
        [(expert, slot, evicted expert or -1)], at most the cap, in order. admit=False: only the step's accesses."""
        ids = np.asarray(ids, dtype=np.int64)
        self.clock += 1
        hit = self.slot_of[ids] >= 0
        self.freq[ids] += 1 if self.policy == "lfu" else hit
        self.last[ids] = self.clock
        if not admit or self.cap == 0 or hit.all():
            return []
        ups: list[tuple[int, int, int]] = []
        for e in ids[~hit].tolist():
            if len(ups) == self.cap:
                break
            victim = -1
            if self._free:
                slot = self._free.pop(0)
            else:
                victim = self._victim(ids)
                if self.policy == "lfu" and self.freq[e] <= self.freq[victim]:
                    continue  # a rarer expert does not displace a busier one
                slot = int(self.slot_of[victim])
                self.slot_of[victim] = -1
            self.slot_of[e] = slot
            self.expert_in[slot] = e
            self.gen[slot] += 1
            if self.policy == "lfru":
                self.freq[e] = 1
            ups.append((int(e), slot, victim))
        return ups

    def _victim(self, protect: np.ndarray) -> int:
        """The resident with the least policy value, never one of the step's experts; ties: the least recently
        used, then the lower expert (SlotPool's order)."""
        res = self.expert_in  # every slot is taken here
        last = self.last[res]
        if self.policy == "lru":  # one integer key: (last, expert)
            key = last * len(self.slot_of) + res
            key[self.slot_of[protect][self.slot_of[protect] >= 0]] = _NEVER
            return int(res[key.argmin()])
        if self.policy == "lfu":
            key = self.freq[res].astype(np.float64)
        else:
            key = self.freq[res] / (self.clock - last + 1.0)
        mine = self.slot_of[protect]
        key[mine[mine >= 0]] = np.inf
        least = key == key.min()
        if np.count_nonzero(least) == 1:
            return int(res[least.argmax()])
        return int(res[np.lexsort((res, last, key))[0]])


@dataclass
class CacheStats:
    """Decode steps (one token) of the cached layers: per layer (rows of CacheBook.layers)."""

    lookups: np.ndarray  # routed experts looked up
    hits: np.ndarray  # of them found in a slot on the device (the GPU ran them)
    uploads: np.ndarray  # experts copied into slots
    upload_bytes: np.ndarray
    steps: np.ndarray  # decode steps
    batches: int = 0  # few-token batches (speculative checks) served: hits on the GPU, no inserts
    batch_hits: int = 0
    batch_lookups: int = 0
    late: int = 0  # uploads whose slot was taken again before their copy finished

    @classmethod
    def zeros(cls, n: int) -> CacheStats:
        z = lambda: np.zeros(n, dtype=np.int64)  # noqa: E731
        return cls(z(), z(), z(), z(), z())

    @property
    def hit_rate(self) -> float:
        return float(self.hits.sum() / max(int(self.lookups.sum()), 1))

    def layer_hit_rates(self) -> np.ndarray:
        return self.hits / np.maximum(self.lookups, 1)

    @property
    def tokens(self) -> int:
        return int(self.steps.max()) if self.steps.size else 0

    def per_token(self) -> tuple[float, float]:
        """(uploads, bytes) per decode token, all layers together."""
        n = max(self.tokens, 1)
        return float(self.uploads.sum() / n), float(self.upload_bytes.sum() / n)


class CacheBook:
    """Every cached layer's LayerSlots, the uploads in flight and the counts. layers: the model's layer index of
    each row; expert_bytes[row]: bytes one expert's upload copies (gate + up + down)."""

    def __init__(self, layers: tuple[int, ...], n_expert: int, top_k: int, n_slots: int, policy: str,
                 max_inserts: int | None, expert_bytes: tuple[int, ...]) -> None:
        self.layers, self.n_slots = tuple(layers), n_slots
        self.rows = {il: r for r, il in enumerate(self.layers)}
        self.slots = [LayerSlots(n_expert, top_k, n_slots, policy, max_inserts) for _ in self.layers]
        self.expert_bytes = np.asarray(expert_bytes, dtype=np.int64)
        self.stats = CacheStats.zeros(len(self.layers))
        self._pending: deque = deque()  # (token, row, [(expert, slot, gen)]) in issue order

    def decode(self, row: int, ids: np.ndarray, found: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """One token of layer `row`: ids (k,) its experts, found (k,) their slots on the device or -1 (what the GPU
        ran) -> (miss (k,) bool: what the CPU runs, the uploads to start [(expert, slot, evicted or -1)])."""
        miss = found < 0
        s = self.stats
        s.steps[row] += 1
        s.lookups[row] += miss.size
        s.hits[row] += miss.size - int(miss.sum())
        ups = self.slots[row].step(ids)
        s.uploads[row] += len(ups)
        s.upload_bytes[row] += len(ups) * int(self.expert_bytes[row])
        return miss, ups

    def batch(self, found: np.ndarray) -> np.ndarray:
        """A few-token batch (a speculative check): found (n_tok, k) -> miss (n_tok, k); counted apart, nothing
        admitted, the policy's state untouched (no inserts from multi-token batches)."""
        miss = found < 0
        self.stats.batches += 1
        self.stats.batch_lookups += miss.size
        self.stats.batch_hits += miss.size - int(miss.sum())
        return miss

    def issued(self, token, row: int, ups: list[tuple[int, int, int]]) -> None:
        """The copies of `ups` were started; `token` (e.g. the event after them) comes back to settle's done()."""
        if ups:
            gen = self.slots[row].gen
            self._pending.append((token, row, [(e, s, int(gen[s])) for e, s, _ in ups]))

    def settle(self, done) -> list[tuple[int, int, int]]:
        """The table entries to validate now: [(row, expert, slot)] of the uploads whose copy is done (done(token)
        True; tokens are asked in issue order, stopping at the first not done) and whose slot still holds that
        expert from that insert."""
        out = []
        while self._pending and done(self._pending[0][0]):
            _, row, items = self._pending.popleft()
            ls = self.slots[row]
            for e, s, g in items:
                if ls.expert_in[s] == e and ls.gen[s] == g:
                    out.append((row, e, s))
                else:
                    self.stats.late += 1
        return out

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def summary(self) -> str:
        """One line: the decode hit rate overall and per layer, uploads and bytes per token."""
        from hybrid.system.sizes import format_size  # noqa: PLC0415

        s = self.stats
        ups, nbytes = s.per_token()
        per_layer = " ".join(f"{il}:{r:.2f}" for il, r in zip(self.layers, s.layer_hit_rates()))
        line = (f"moe cache: {self.n_slots} slots x {len(self.layers)} layers, decode hit rate {s.hit_rate:.1%} over "
                f"{s.tokens} tokens, {ups:.2f} uploads/token ({format_size(int(nbytes), 2)}/token); "
                f"per layer {per_layer}")
        if s.batches:
            line += f"; {s.batches} multi-token batches, hit rate {s.batch_hits / max(s.batch_lookups, 1):.1%}"
        return line
