"""The runtime expert cache's host logic, no GPU: LayerSlots makes SlotPool's decisions one step at a time (replayed
side by side on random skewed traces, every policy and cap), hand-made LRU/LFRU orders, the cap, the per-layer
floor and no inserts outside decode; CacheBook counts what the device found and validates only finished, still
current copies; `missed` hands the CPU each token's misses; the lookup's numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.backends.moe_cache.book import CacheBook, LayerSlots
from hybrid.backends.moe_cache.policy import SlotPool
from hybrid.backends.moe_cache.runtime import missed
from kernels_gpu.moe_cache import lookup_reference


def _trace(seed: int, n_tok: int, n_expert: int, k: int) -> np.ndarray:
    """(n_tok, k) distinct experts a token, Zipf-skewed, in routing order."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_expert + 1)
    p = rng.permutation(p / p.sum())
    return np.stack([rng.choice(n_expert, k, replace=False, p=p) for _ in range(n_tok)])


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru"])
@pytest.mark.parametrize("cap", [None, 2, 1])
@pytest.mark.parametrize("n_slots", [9, 16, 40])
def test_layer_slots_decide_as_slot_pool(policy, cap, n_slots):
    n_expert, k = 64, 8
    ids = _trace(3, 300, n_expert, k)
    ref = SlotPool(1, n_expert, k, n_slots, policy, cap)
    fast = LayerSlots(n_expert, k, n_slots, policy, cap)
    total = 0
    for t in range(ids.shape[0]):
        ref.access(ids[t][None])
        ups = fast.step(ids[t])
        want = list(zip(ref.uploads[1].tolist(), ref.uploads[2].tolist()))
        assert [(e, s) for e, s, _ in ups] == want, t
        assert len(ups) <= (k if cap is None else cap)
        total += len(ups)
        np.testing.assert_array_equal(fast.slot_of, ref.slot_of[0])
    assert total == int(ref.inserts[0]) and total > 0


def test_lru_evicts_the_least_recently_used_and_never_the_steps_own():
    ls = LayerSlots(n_expert=8, top_k=2, n_slots=3, policy="lru")
    assert ls.step([0, 1]) == [(0, 0, -1), (1, 1, -1)]
    assert ls.step([2, 0]) == [(2, 2, -1)]  # 0 hits
    # full: 1 hits; 0 and 2 were last used at step 2: the tie goes to the lower expert
    assert ls.step([3, 1]) == [(3, 0, 0)]
    assert ls.step([4, 3]) == [(4, 2, 2)]  # 2 is the least recent; 3 (this step's own) stays


def test_lfru_prefers_the_frequent_over_the_recent():
    ls = LayerSlots(n_expert=8, top_k=1, n_slots=2, policy="lfru")
    for e in (0, 0, 0, 1):  # 0: entered, then 2 hits (freq 3); 1: entered at step 4 (freq 1)
        ls.step([e])
    ups = ls.step([2])  # scores at step 5: 0 -> 3 / 3 = 1.0, 1 -> 1 / 2 = 0.5: 1 goes
    assert ups == [(2, 1, 1)] and ls.slot_of[0] == 0


def test_the_cap_and_no_admission():
    ls = LayerSlots(n_expert=32, top_k=8, n_slots=9, policy="lru", max_inserts=2)
    assert len(ls.step(np.arange(8))) == 2
    before = ls.slot_of.copy()
    assert ls.step(np.arange(8, 16), admit=False) == []  # a step that admits nothing changes no slot
    np.testing.assert_array_equal(ls.slot_of, before)
    assert len(ls.step(np.arange(8, 16))) == 2
    zero = LayerSlots(n_expert=32, top_k=8, n_slots=9, max_inserts=0)
    assert zero.step(np.arange(8)) == [] and (zero.slot_of < 0).all()


def test_a_layer_needs_top_k_plus_one_slots():
    with pytest.raises(ValueError, match="top_k \\+ 1 = 9"):
        LayerSlots(n_expert=64, top_k=8, n_slots=8)
    with pytest.raises(ValueError, match="unknown cache policy"):
        LayerSlots(n_expert=64, top_k=8, n_slots=9, policy="fifo")


def _book(**kw) -> CacheBook:
    args = dict(layers=(3, 5), n_expert=16, top_k=2, n_slots=4, policy="lru", max_inserts=2,
                expert_bytes=(1000, 2000))
    args.update(kw)
    return CacheBook(**args)


def test_book_counts_the_devices_hits_and_the_uploads():
    book = _book()
    miss, ups = book.decode(0, np.array([1, 2]), np.array([-1, -1]))
    assert miss.tolist() == [True, True] and [(e, s) for e, s, _ in ups] == [(1, 0), (2, 1)]
    # the next token: 1 is in the host's table but its copy may not be done: the device's word counts
    miss, ups = book.decode(0, np.array([1, 3]), np.array([-1, -1]))
    assert miss.tolist() == [True, True] and [(e, s) for e, s, _ in ups] == [(3, 2)]
    miss, _ = book.decode(0, np.array([1, 3]), np.array([0, 2]))
    assert miss.tolist() == [False, False]
    s = book.stats
    assert (s.lookups.tolist(), s.hits.tolist(), s.uploads.tolist()) == ([6, 0], [2, 0], [3, 0])
    assert s.upload_bytes.tolist() == [3000, 0] and s.tokens == 3
    assert s.hit_rate == pytest.approx(2 / 6) and s.per_token() == (1.0, 1000.0)
    assert "33.3%" in book.summary() and "3:0.33" in book.summary()


def test_book_validates_finished_copies_in_order_and_never_a_retaken_slot():
    book = _book(n_slots=3, top_k=2, max_inserts=2)
    _, ups = book.decode(0, np.array([1, 2]), np.array([-1, -1]))
    book.issued("a", 0, ups)
    _, ups = book.decode(0, np.array([3, 4]), np.array([-1, -1]))  # slot 2 for 3; then 1 evicted for 4
    assert [(e, s, v) for e, s, v in ups] == [(3, 2, -1), (4, 0, 1)]
    book.issued("b", 0, ups)
    done = {"a"}
    assert book.settle(lambda tok: tok in done) == [(0, 2, 1)]  # 1's copy finished, but slot 0 holds 4 now
    assert book.stats.late == 1 and book.in_flight == 1
    assert book.settle(lambda tok: tok in done) == []  # "b" not done: nothing, nothing skipped past it
    done.add("b")
    assert sorted(book.settle(lambda tok: tok in done)) == [(0, 3, 2), (0, 4, 0)]
    assert book.in_flight == 0


def test_a_few_token_batch_inserts_nothing():
    book = _book()
    found = np.array([[-1, 2], [-1, -1]])
    miss = book.batch(found)
    assert miss.tolist() == [[True, False], [True, True]]
    assert book.stats.uploads.sum() == 0 and book.stats.lookups.sum() == 0
    assert (book.stats.batches, book.stats.batch_hits, book.stats.batch_lookups) == (1, 1, 4)
    assert all((ls.slot_of < 0).all() and ls.clock == 0 for ls in book.slots)


def test_missed_gives_each_tokens_misses_padded_at_weight_zero():
    ids = np.array([[5, 1, 7, 2], [3, 4, 6, 0]], dtype=np.int32)
    w = np.array([[0.4, 0.3, 0.2, 0.1], [0.5, 0.2, 0.2, 0.1]], dtype=np.float32)
    miss = np.array([[False, True, False, True], [True, False, False, False]])
    sel_ids, sel_w = missed(ids, w, miss)
    assert sel_ids.tolist() == [[1, 2], [3, 4]]
    np.testing.assert_allclose(sel_w, [[0.3, 0.1], [0.5, 0.0]], rtol=1e-6)
    # any per-expert function, weighted: the CPU's share plus the hits' equals the whole
    f = np.random.default_rng(0).standard_normal(8)
    whole = (w * f[ids]).sum(1)
    hits = np.where(miss, 0, w * f[ids]).sum(1)
    np.testing.assert_allclose((sel_w * f[sel_ids]).sum(1) + hits, whole, rtol=1e-6)
    one_ids, one_w = missed(ids[:1], w[:1], miss[:1])
    assert one_ids.shape == (1, 2)
    np.testing.assert_allclose(one_w, [[0.3, 0.1]], rtol=1e-6)


def test_lookup_reference():
    table = np.array([-1, 2, -1, 0], dtype=np.int32)
    found, slots, wh = lookup_reference(table, np.array([[1, 2], [3, 0]]), np.ones((2, 2), np.float32), 5)
    assert found.tolist() == [[2, -1], [0, -1]] and slots.tolist() == [[2, 5], [0, 5]]
    assert wh.tolist() == [[1.0, 0.0], [1.0, 0.0]]
