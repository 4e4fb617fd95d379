"""The expert-cache policies (hybrid/backends/moe_cache/policy.py, belady.py, simulate.py) on hand-made traces:
LRU's and LFRU's eviction order, LFU's admission by count, the insert cap, the floor of top_k + 1 slots, a step's
experts never evicted, Belady equal to an exhaustive optimum and above every online policy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hybrid.backends.moe_cache.belady import belady
from hybrid.backends.moe_cache.policy import POLICIES, SlotPool, static_resident
from hybrid.backends.moe_cache.simulate import ALL_POLICIES, default_slots, simulate
from hybrid.backends.moe_cache.trace import ExpertTrace


def _run(pool: SlotPool, steps) -> list[list[bool]]:
    """Each step's experts (one layer) through pool -> its hits."""
    return [pool.access(np.array([s])).reshape(-1).tolist() for s in steps]


def _resident(pool: SlotPool, layer: int = 0) -> set[int]:
    return {int(e) for e in np.nonzero(pool.slot_of[layer] >= 0)[0]}


def test_lru_evicts_the_least_recently_used():
    pool = SlotPool(1, 8, 2, 3, "lru")
    assert _run(pool, [[0, 1], [2, 0]]) == [[False, False], [False, True]]
    assert _resident(pool) == {0, 1, 2}
    slot_of_1 = pool.slot_of[0, 1]
    assert _run(pool, [[3, 2]]) == [[False, True]]  # 1 (last used at step 1) goes, not 0 (step 2)
    assert _resident(pool) == {0, 2, 3} and pool.slot_of[0, 3] == slot_of_1
    assert [a.tolist() for a in pool.uploads] == [[0], [3], [int(slot_of_1)]]  # (layer, expert, slot)
    _run(pool, [[4, 3]])
    assert _resident(pool) == {2, 3, 4}  # then 0 (step 2) before 2 (step 3)


def test_lfru_keeps_a_busy_expert_lru_would_drop():
    steps = [[0], [0], [0], [0], [1], [2]]  # 0: freq 4, last used at step 4; 1: freq 1, step 5
    lru, lfru = SlotPool(1, 8, 1, 2, "lru"), SlotPool(1, 8, 1, 2, "lfru")
    _run(lru, steps)
    _run(lfru, steps)
    assert _resident(lru) == {1, 2}  # 0 was used least recently
    assert _resident(lfru) == {0, 2}  # 0 scores 4 / (6 - 4 + 1) = 1.33, 1 scores 1 / (6 - 5 + 1) = 0.5
    assert lfru.freq[0, 0] == 4 and lfru.freq[0, 2] == 1  # + 1 a hit; 1 on entry
    # LFRU's score ages: 0 unused for long enough falls below a newer expert's
    _run(lfru, [[2], [2], [3], [2], [3]])
    assert _resident(lfru) == {2, 3}


def test_lfu_admits_by_count_over_the_whole_history():
    pool = SlotPool(1, 8, 1, 2, "lfu")
    _run(pool, [[0], [0], [1], [1], [1]])  # counts 0: 2, 1: 3
    assert _resident(pool) == {0, 1}
    _run(pool, [[2]])  # count 1 < 2: 2 runs as a miss and does not displace 0
    assert _resident(pool) == {0, 1} and pool.inserts[0] == 2
    _run(pool, [[2], [2]])  # count 3 > 2: it displaces 0 (the least counted)
    assert _resident(pool) == {1, 2} and pool.inserts[0] == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_the_insert_cap_bounds_uploads_per_layer_and_step(policy):
    pool = SlotPool(2, 16, 4, 8, policy, max_inserts=1)
    hits = pool.access(np.array([[0, 1, 2, 3], [4, 5, 6, 7]]))
    assert not hits.any()
    assert pool.inserts.tolist() == [1, 1] and _resident(pool, 0) == {0} and _resident(pool, 1) == {4}
    assert sorted(pool.uploads[1].tolist()) == [0, 4]  # the first (heaviest) expert of each layer
    pool.access(np.array([[0, 1, 2, 3], [4, 5, 6, 7]]))
    assert pool.inserts.tolist() == [2, 2] and _resident(pool, 0) == {0, 1}
    frozen = SlotPool(1, 16, 4, 8, policy, max_inserts=0)
    for _ in range(3):
        assert not frozen.access(np.array([[0, 1, 2, 3]])).any()
    assert frozen.inserts[0] == 0
    assert not pool.access(np.array([[8, 9, 10, 11]]), layers=[0], admit=False).any()  # a prefill: no inserts
    assert pool.inserts[0] == 2 and pool.accesses[0] == 12


def test_a_layer_needs_top_k_plus_one_slots():
    with pytest.raises(ValueError, match="top_k \\+ 1 = 5"):
        SlotPool(1, 32, 4, 4)
    SlotPool(1, 32, 4, 5)
    with pytest.raises(ValueError, match="n_expert"):
        SlotPool(1, 32, 4, 33)
    trace = _random_trace(np.random.default_rng(0), 40, 2, 16, 4)
    with pytest.raises(ValueError, match="top_k \\+ 1, n_expert"):
        simulate(trace, [4])
    assert default_slots(4, 32)[0] == 5 and default_slots(4, 32)[-1] == 32
    assert default_slots(8, 128) == [9, 16, 32, 48, 64, 96, 128]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_steps_experts_stay_resident_and_the_lookup_agrees(policy):
    rng = np.random.default_rng(1)
    pool = SlotPool(3, 16, 4, 5, policy)
    for _ in range(200):
        ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(3)])
        before = pool.slot_of.copy()
        hits = pool.access(ids)
        assert (hits == (before[np.arange(3)[:, None], ids] >= 0)).all()
        for layer in range(3):  # a hit keeps its slot through the step; the table and the slots agree
            assert (pool.slot_of[layer, ids[layer][hits[layer]]] == before[layer, ids[layer][hits[layer]]]).all()
            live = pool.expert_in[layer] >= 0
            assert (pool.slot_of[layer, pool.expert_in[layer][live]] == np.nonzero(live)[0]).all()
            assert live.sum() == (pool.slot_of[layer] >= 0).sum() <= 5
        assert (pool.lookup(ids) >= 0).sum() >= hits.sum()


def _optimum(seq: list[list[int]], n_slots: int) -> int:
    """The most hits any cache of n_slots (any start, bypass allowed) gets on steps seq, one request at a time:
    an exhaustive search over the cache's contents."""
    experts = sorted({e for s in seq for e in s})
    best = {frozenset(c): 0 for c in itertools.combinations(experts, min(n_slots, len(experts)))}
    for step in seq:
        for e in step:
            nxt: dict[frozenset, int] = {}
            for state, h in best.items():
                options = [(state, h + 1)] if e in state else [(state, h)] + [
                    (state - {v} | {e}, h) for v in state]
                for s2, h2 in options:
                    if nxt.get(s2, -1) < h2:
                        nxt[s2] = h2
            best = nxt
    return max(best.values())


def test_belady_on_a_known_sequence():
    hits, inserts = belady(np.array([[0], [1], [2], [0], [1], [2]]), 4, 2)
    assert hits.reshape(-1).tolist() == [True, True, False, True, True, False] and inserts == 0  # 2 bypasses
    hits, _ = belady(np.array([[0, 1], [2, 0], [3, 2], [0, 1], [2, 3], [1, 0]]), 4, 3)
    assert hits.sum() == _optimum([[0, 1], [2, 0], [3, 2], [0, 1], [2, 3], [1, 0]], 3)


@pytest.mark.parametrize("seed", range(6))
def test_belady_equals_the_exhaustive_optimum(seed):
    rng = np.random.default_rng(seed)
    k, n_expert, n_slots = (1, 2)[seed % 2], 6, 3
    seq = [rng.choice(n_expert, k, replace=False, p=np.array([6, 5, 4, 3, 2, 1]) / 21).tolist() for _ in range(10)]
    hits, _ = belady(np.array(seq), n_expert, n_slots)
    assert hits.sum() == _optimum(seq, n_slots), seq


def _random_trace(rng, n_tok: int, n_layer: int, n_expert: int, k: int, zipf: float = 1.0) -> ExpertTrace:
    """Tokens routed to k distinct experts a layer, a Zipf-like popularity each layer (shuffled per layer), with
    runs of repeats (as neighbouring tokens route alike)."""
    ids = np.empty((n_tok, n_layer, k), dtype=np.int16)
    for il in range(n_layer):
        p = 1.0 / np.arange(1, n_expert + 1) ** zipf
        p = rng.permutation(p / p.sum())
        for t in range(n_tok):
            ids[t, il] = ids[t - 1, il] if t and rng.random() < 0.3 else rng.choice(n_expert, k, replace=False, p=p)
    return ExpertTrace(ids, np.full(ids.shape, 1.0 / k, np.float32), np.arange(n_layer, dtype=np.int32),
                       np.zeros(n_tok, np.int32), n_expert, "random")


@pytest.mark.parametrize("seed,inserts", [(0, None), (1, 1), (2, 2)])
def test_belady_bounds_every_policy(seed, inserts):
    trace = _random_trace(np.random.default_rng(seed), 300, 3, 16, 4)
    results = simulate(trace, [5, 8, 12], max_inserts=inserts)
    assert [r.policy for r in results[:len(ALL_POLICIES)]] == list(ALL_POLICIES)
    for s in (5, 8, 12):
        rs = {r.policy: r for r in results if r.n_slots == s}
        for p, r in rs.items():
            assert (rs["belady"].layer_hits >= r.layer_hits - 1e-12).all(), (s, p)
        assert rs["static"].uploads_per_token == 0
        if inserts is not None:
            for p in POLICIES:
                assert rs[p].uploads_per_token <= inserts * trace.ids.shape[1]
    full = simulate(trace, [16])
    assert all(r.hit_rate == 1.0 for r in full)  # every expert resident (all seen in the first half)


def test_static_list_and_the_simulation_are_deterministic():
    counts = np.array([[5, 9, 9, 1], [0, 0, 3, 2]])
    assert static_resident(counts, 2).tolist() == [[False, True, True, False], [False, False, True, True]]
    trace = _random_trace(np.random.default_rng(4), 120, 2, 16, 4)
    a = [r.to_json() for r in simulate(trace, [6, 10], max_inserts=2)]
    assert a == [r.to_json() for r in simulate(trace, [6, 10], max_inserts=2)]
