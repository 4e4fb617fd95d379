"""kernels_gpu.moe_upload.plan_upload (host-side, no GPU): the layout the uploaded experts' tensor-core prefill
runs on. Every (token, expert) pair gets one row; rows are grouped by expert, experts ascending, tokens ascending
within; a chunk holds at most `capacity` used experts; its tiles name their expert by its place in the chunk and
cover that expert's rows exactly, at most MM_BM rows each; its copies are its runs of consecutive experts."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_gpu.moe_upload import MM_BM, plan_upload


def _routes(n_tok: int, n_expert: int, k: int, skew: float, rng) -> np.ndarray:
    scores = rng.random((n_tok, n_expert)) + skew * (np.arange(n_expert) == 3)  # expert 3 takes every token
    scores[:, n_expert // 2:n_expert // 2 + 3] -= 2.0  # and a few experts in the middle none
    return np.argsort(-scores, axis=1)[:, :k].astype(np.int32)


def _expert_of_row(plan, ids: np.ndarray) -> np.ndarray:
    """The expert of each of the plan's rows (ids (n_tok, k): the batch the plan was made from)."""
    pair_of_row = np.empty(ids.size, dtype=np.int64)
    pair_of_row[plan.dest] = np.arange(ids.size)
    return ids.reshape(-1)[pair_of_row]


@pytest.mark.parametrize("n_tok,n_expert,k,capacity,skew", [
    (512, 128, 8, 21, 1.0), (9, 8, 3, 2, 1.0), (300, 16, 2, 1, 0.0), (64, 64, 4, 64, 0.5), (1, 4, 4, 3, 0.0)])
def test_every_pair_has_one_row_in_its_experts_tiles(n_tok, n_expert, k, capacity, skew):
    rng = np.random.default_rng(n_tok * 7 + capacity)
    ids = _routes(n_tok, n_expert, k, skew, rng)
    plan = plan_upload(ids, n_expert, capacity)
    n_pairs = n_tok * k
    assert sorted(plan.dest.tolist()) == list(range(n_pairs))  # one row a pair
    pair_of_row = np.empty(n_pairs, dtype=np.int64)
    pair_of_row[plan.dest] = np.arange(n_pairs)
    assert np.array_equal(plan.src, pair_of_row // k)  # each row's token
    expert_of_row = _expert_of_row(plan, ids)
    assert np.all(np.diff(expert_of_row) >= 0)  # grouped by expert, ascending
    same = np.diff(expert_of_row) == 0
    assert np.all(np.diff(plan.src)[same] > 0)  # tokens ascending within an expert
    used = np.unique(ids)
    assert np.array_equal(np.concatenate([c.experts for c in plan.chunks]), used)
    covered = np.zeros(n_pairs, dtype=np.int64)
    for c in plan.chunks:
        assert 1 <= c.experts.size <= capacity
        tiles = plan.tiles[c.tile0:c.tile0 + c.n_tiles]
        for place, row0, rows, zero in tiles.tolist():
            assert 1 <= rows <= MM_BM and zero == 0
            assert np.all(expert_of_row[row0:row0 + rows] == c.experts[place])
            covered[row0:row0 + rows] += 1
        # the copies: runs of consecutive experts, back to back in the slot in the chunk's order
        places = []
        for e0, e1, first in c.runs:
            assert e1 > e0 and first == len(places)
            places.extend(range(e0, e1))
        assert places == c.experts.tolist()
    assert sum(c.n_tiles for c in plan.chunks) == plan.tiles.shape[0]
    assert np.all(covered == 1)


def test_a_slot_must_hold_an_expert():
    with pytest.raises(ValueError, match="at least one expert"):
        plan_upload(np.zeros((4, 2), dtype=np.int32), 8, 0)


def test_ids_outside_the_experts_are_refused():
    with pytest.raises(ValueError, match="outside"):
        plan_upload(np.array([[0, 9]], dtype=np.int32), 8, 4)


def test_experts_in_an_expert_cache_form_one_chunk_named_by_their_slots():
    rng = np.random.default_rng(3)
    n_expert, k = 32, 4
    ids = _routes(200, n_expert, k, 1.0, rng)
    resident = np.full(n_expert, -1, dtype=np.int32)
    resident[[3, 5, 6, 20]] = [7, 0, 2, 1]  # expert 3 takes every token; 20 may take none
    plan = plan_upload(ids, n_expert, 5, resident=resident)
    used = np.unique(ids)
    here = used[resident[used] >= 0]
    first = plan.chunks[0]
    assert first.resident and first.runs == () and first.experts.tolist() == here.tolist()
    expert_of_row = _expert_of_row(plan, ids)
    covered = np.zeros(ids.size, dtype=np.int64)
    for c in plan.chunks:
        for place, row0, rows, _ in plan.tiles[c.tile0:c.tile0 + c.n_tiles].tolist():
            want = np.flatnonzero(resident == place) if c.resident else [c.experts[place]]
            assert len(want) == 1 and np.all(expert_of_row[row0:row0 + rows] == want[0])
            covered[row0:row0 + rows] += 1
    assert np.all(covered == 1)
    rest = np.concatenate([c.experts for c in plan.chunks[1:]])
    assert rest.tolist() == [e for e in used.tolist() if resident[e] < 0]  # uploaded: the others only
    assert all(not c.resident and c.experts.size <= 5 for c in plan.chunks[1:])
    none = plan_upload(ids, n_expert, 5, resident=np.full(n_expert, -1))
    assert not any(c.resident for c in none.chunks)
    plain = plan_upload(ids, n_expert, 5)
    assert [c.experts.tolist() for c in none.chunks] == [c.experts.tolist() for c in plain.chunks]
