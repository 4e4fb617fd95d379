"""Belady's offline optimum for one layer's expert cache (furthest next use evicted), the upper bound of every
policy of `policy`: the steps' experts taken one at a time, an expert still to come in the same step counting as
used now (so never evicted for a sibling); a miss enters only if the victim's next use is later than its own
(misses may run elsewhere: the cache need not take them); the pool starts holding the n_slots experts used
soonest (a warm start at no cost, the best there is)."""

from __future__ import annotations

import numpy as np

_INF = np.iinfo(np.int64).max


def next_uses(ids: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """ids (n_step, k) -> (after (n_step, k) int64: the next step that routes ids[t, j] again, _INF for none;
    first (n_expert,) int64: each expert's first step, _INF for none)."""
    n_step, k = ids.shape
    after = np.empty((n_step, k), dtype=np.int64)
    nxt = np.full(n_expert, _INF, dtype=np.int64)
    for t in range(n_step - 1, -1, -1):
        row = ids[t]
        after[t] = nxt[row]
        nxt[row] = t
    return after, nxt


def belady(ids: np.ndarray, n_expert: int, n_slots: int) -> tuple[np.ndarray, int]:
    """One layer's steps ids (n_step, k) through an optimal cache of n_slots -> (hits (n_step, k) bool, inserts)."""
    ids = np.asarray(ids, dtype=np.int64)
    n_step, k = ids.shape
    if n_slots < k + 1:
        raise ValueError(f"belady: need at least top_k + 1 = {k + 1} slots, found {n_slots}")
    after, first = next_uses(ids, n_expert)
    resident = np.zeros(n_expert, dtype=bool)
    warm = np.argsort(first, kind="stable")[:n_slots]
    resident[warm[first[warm] < _INF]] = True
    when = np.where(resident, first, _INF)  # a resident's next use
    n_in = int(resident.sum())
    hits = np.zeros((n_step, k), dtype=bool)
    inserts = 0
    for t in range(n_step):
        row = ids[t]
        when[row] = t  # the step's experts: used now
        for j in range(k):
            e = row[j]
            if resident[e]:
                hits[t, j] = True
                when[e] = after[t, j]
                continue
            if n_in < n_slots:
                resident[e] = True
                n_in += 1
            else:
                victim = int(np.argmax(np.where(resident, when, -1)))
                if when[victim] <= after[t, j]:  # keeping what is here serves as soon or sooner: bypass
                    continue
                resident[victim] = False
                resident[e] = True
            when[e] = after[t, j]
            inserts += 1
    return hits, inserts
