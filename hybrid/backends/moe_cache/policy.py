"""Per-layer slot pools of a GPU expert cache and their online policies (docs/MOE_CACHE.md).

`SlotPool` holds, for each MoE layer, n_slots slots and the table lookup[layer, expert] -> slot or -1. One
`access(ids)` is one step (a decode token) of the layers given: the hits are one vectorized lookup; then the
misses are admitted in routing order (the heavier expert first), at most `max_inserts` a layer a step, each into a
free slot or over the victim of the policy. The experts of the step are never evicted by it (their slots are in
use), which is why a layer needs at least top_k + 1 slots. Policies (a victim is the resident with the least):

    lru    last access
    lfu    accesses over the whole history (resident or not); a miss enters only if it has more than the victim
    lfru   freq / (clock - last + 1), freq = 1 on entry and + 1 a hit (vLLM #37190)

Ties go to the least recently used, then the lower expert: deterministic. `static_resident` is the static list.
"""

from __future__ import annotations

import numpy as np

POLICIES = ("lru", "lfu", "lfru")
_NEVER = np.iinfo(np.int64).max


def check_slots(n_expert: int, top_k: int, n_slots: int, policy: str) -> None:
    """ValueError unless `policy` is known and a layer has top_k + 1 to n_expert slots."""
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if not top_k + 1 <= n_slots <= n_expert:
        raise ValueError(f"a layer's expert cache needs top_k + 1 = {top_k + 1} to n_expert = {n_expert} slots "
                         f"(a step's own experts are never evicted), found {n_slots}")


class SlotPool:
    """Slot pools of n_layer MoE layers of n_expert experts, top_k routed a token, n_slots each (see module)."""

    def __init__(self, n_layer: int, n_expert: int, top_k: int, n_slots: int, policy: str = "lfru",
                 max_inserts: int | None = None) -> None:
        check_slots(n_expert, top_k, n_slots, policy)
        if max_inserts is not None and max_inserts < 0:
            raise ValueError(f"max_inserts must be >= 0 (or None: no cap), found {max_inserts}")
        self.n_layer, self.n_expert, self.top_k, self.n_slots = n_layer, n_expert, top_k, n_slots
        self.policy, self.max_inserts = policy, max_inserts
        self.slot_of = np.full((n_layer, n_expert), -1, dtype=np.int32)  # lookup[layer, expert] -> slot or -1
        self.expert_in = np.full((n_layer, n_slots), -1, dtype=np.int32)  # slot -> its expert or -1 (free)
        self.last = np.full((n_layer, n_expert), -1, dtype=np.int64)  # clock of the last access
        self.freq = np.zeros((n_layer, n_expert), dtype=np.int64)  # lfu: all accesses; lfru: hits since entry + 1
        self.clock = np.zeros(n_layer, dtype=np.int64)  # steps a layer has seen
        self.accesses = np.zeros(n_layer, dtype=np.int64)  # routed experts looked up, per layer
        self.hits = np.zeros(n_layer, dtype=np.int64)
        self.inserts = np.zeros(n_layer, dtype=np.int64)  # experts admitted (each one upload)
        # the inserts of the last access: (layer, expert, slot) int64 each, the uploads a runtime would start
        self.uploads = (np.empty(0, np.int64),) * 3

    def _layers(self, ids: np.ndarray, layers) -> np.ndarray:
        layers = np.arange(self.n_layer) if layers is None else np.asarray(layers, dtype=np.int64).reshape(-1)
        if ids.ndim != 2 or ids.shape[0] != layers.shape[0]:
            raise ValueError(f"expected ids (n_layers, k) for {layers.shape[0]} layers, found {ids.shape}")
        return layers

    def lookup(self, ids: np.ndarray, layers=None) -> np.ndarray:
        """The slot of each expert of ids (n, k) in layers (n,) (default: every layer) or -1; no state changes."""
        ids = np.asarray(ids, dtype=np.int64)
        layers = self._layers(ids, layers)
        return self.slot_of[layers[:, None], ids]

    def access(self, ids: np.ndarray, layers=None, admit: bool = True) -> np.ndarray:
        """One step: ids (n, k) the distinct experts each of layers (n,) distinct (default: every layer, in order)
        routes to -> hits (n, k) bool. Counts the step; admit=False looks up and counts only (a prefill batch
        inserts nothing)."""
        ids = np.asarray(ids, dtype=np.int64)
        layers = self._layers(ids, layers)
        rows = layers[:, None]
        self.clock[layers] += 1
        now = self.clock[layers]  # (n,)
        hit = self.slot_of[rows, ids] >= 0
        self.accesses[layers] += ids.shape[1]
        self.hits[layers] += hit.sum(axis=1)
        self.freq[rows, ids] += 1 if self.policy == "lfu" else hit
        self.last[rows, ids] = now[:, None]
        self.uploads = (np.empty(0, np.int64),) * 3
        if admit:
            self._admit(layers, ids, ~hit, now)
        return hit

    def _victim_key(self, layers: np.ndarray, now: np.ndarray) -> np.ndarray:
        """(n, n_expert) float: the policy's value of each expert of layers (the least is evicted first)."""
        last, freq = self.last[layers], self.freq[layers]
        if self.policy == "lru":
            return last.astype(np.float64)
        if self.policy == "lfu":
            return freq.astype(np.float64)
        return freq / (now[:, None] - last + 1.0)

    def _admit(self, layers: np.ndarray, ids: np.ndarray, miss: np.ndarray, now: np.ndarray) -> None:
        n, k = ids.shape
        cap = k if self.max_inserts is None else min(k, self.max_inserts)
        if cap == 0 or not miss.any():
            return
        protect = np.zeros((n, self.n_expert), dtype=bool)  # the step's experts: their slots are in use
        protect[np.arange(n)[:, None], ids] = True
        done = np.zeros(n, dtype=np.int64)  # inserts this step, per row
        ups: list[tuple[np.ndarray, ...]] = []
        for j in range(k):  # the j-th expert of each row, in routing order
            r = np.nonzero(miss[:, j] & (done < cap))[0]
            if not r.size:
                continue
            lay, cand = layers[r], ids[r, j]
            free = self.expert_in[lay] < 0  # (m, n_slots)
            slot = np.where(free.any(axis=1), free.argmax(axis=1), -1)
            full = slot < 0
            if full.any():
                f = np.nonzero(full)[0]
                key = self._victim_key(lay[f], now[r[f]])
                key[(self.slot_of[lay[f]] < 0) | protect[r[f]]] = np.inf
                least = key.min(axis=1, keepdims=True)
                victim = np.where(key == least, self.last[lay[f]], _NEVER).argmin(axis=1)  # ties: the LRU one
                ok = np.ones(f.size, dtype=bool)
                if self.policy == "lfu":  # admission by count: a rarer expert does not displace a busier one
                    ok = self.freq[lay[f], cand[f]] > self.freq[lay[f], victim]
                f, victim = f[ok], victim[ok]
                slot[f] = self.slot_of[lay[f], victim]
                self.slot_of[lay[f], victim] = -1
                keep = slot >= 0
                r, lay, cand, slot = r[keep], lay[keep], cand[keep], slot[keep]
            self.slot_of[lay, cand] = slot
            self.expert_in[lay, slot] = cand
            if self.policy == "lfru":
                self.freq[lay, cand] = 1
            self.inserts[lay] += 1
            done[r] += 1
            ups.append((lay, cand, slot.astype(np.int64)))
        if ups:
            self.uploads = tuple(np.concatenate(a) for a in zip(*ups))


def static_resident(counts: np.ndarray, n_slots: int) -> np.ndarray:
    """A static cache: (n_layer, n_expert) bool, each layer's n_slots busiest experts of counts (n_layer,
    n_expert) (ties: the lower expert)."""
    order = np.argsort(-counts, axis=1, kind="stable")[:, :n_slots]
    resident = np.zeros(counts.shape, dtype=bool)
    np.put_along_axis(resident, order, True, axis=1)
    return resident
