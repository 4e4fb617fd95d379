"""The paged KV cache's bookkeeping (hybrid.kv.blocks) and the radix prefix cache (hybrid.kv.radix): reference
counts, all-or-nothing allocation, rollback, the split at a partial match, locks, leaf-first LRU eviction, and no
leak after 1,000 random requests."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybrid.kv.blocks import BlockManager, BlockPool, OutOfBlocks
from hybrid.kv.radix import RadixCache

BS = 4


def test_pool_counts_references_and_allocates_all_or_nothing():
    pool = BlockPool(6, BS)
    a = pool.alloc(4)
    assert pool.n_free == 2 and (pool.ref[a] == 1).all()
    with pytest.raises(OutOfBlocks, match="3 KV blocks wanted, 2 of 6 free"):
        pool.alloc(3)
    assert pool.n_free == 2  # nothing taken
    pool.incref(a[:2])
    assert pool.decref(a) == a[2:]  # the shared two stay
    assert pool.decref(a[:2]) == a[:2] and pool.n_free == 6
    with pytest.raises(ValueError):
        pool.decref([a[0]])


def test_manager_shares_prefixes_appends_truncates_and_frees():
    pool = BlockPool(16, BS)
    m = BlockManager(pool)
    t = m.allocate("a", 10)  # 3 blocks
    assert len(t.blocks) == 3 and pool.n_free == 13
    u = m.allocate("b", 9, prefix=t.blocks[:2])  # shares 2 whole blocks
    assert u.blocks[:2] == t.blocks[:2] and pool.ref[t.blocks[0]] == 2 and pool.n_free == 12
    m.append("a", 2)  # 12 tokens: still 3 blocks
    assert len(t.blocks) == 3
    m.append("a", 5)  # 17 tokens: 5 blocks
    assert len(t.blocks) == 5 and t.n_tokens == 17
    m.truncate("a", 9)  # a speculative rollback: blocks 3 and 4 go
    assert len(t.blocks) == 3 and pool.n_free == 12
    m.free("a")
    assert pool.ref[u.blocks[0]] == 1 and pool.n_free == 13
    m.free("b")
    assert pool.n_free == 16 and not pool.ref.any()


def test_radix_match_rounds_down_and_splits_at_a_partial_match():
    pool = BlockPool(32, BS)
    tree = RadixCache(pool)
    a = list(range(12))  # 3 blocks
    blocks_a = pool.alloc(3)
    tree.insert(a, blocks_a)
    n, blocks, node = tree.match(a[:7])  # 7 tokens: one whole block
    assert (n, blocks, node.key) == (4, blocks_a[:1], tuple(a[:4]))  # the edge of 3 blocks split after 1
    b = a[:8] + [99, 98, 97, 96]  # shares 2 blocks, then differs
    n, blocks, node = tree.match(b)
    assert n == 8 and blocks == blocks_a[:2]  # the rest of the edge split after 1 more
    assert node.key == tuple(a[4:8]) and node.parent.key == tuple(a[:4]) and len(node.children) == 1
    blocks_b = blocks + pool.alloc(1)
    end = tree.insert(b, blocks_b)
    assert end.key == (99, 98, 97, 96) and end.parent is node and len(node.children) == 2
    assert pool.ref[blocks_a[0]] == 2  # the caller's and the tree's
    assert tree.match(a)[:2] == (12, blocks_a) and tree.stats.hits == 3


def test_radix_locks_and_evicts_leaf_first_least_recently_used():
    pool = BlockPool(32, BS)
    tree = RadixCache(pool)

    def put(tokens):
        ids = pool.alloc(len(tokens) // BS)
        node = tree.insert(tokens, ids)
        pool.decref(ids)  # the request is done: only the tree holds them
        return node

    common = [1, 2, 3, 4]
    x = put(common + [5, 6, 7, 8])
    y = put(common + [9, 9, 9, 9])
    z = put([7] * 8)
    assert tree.n_blocks == 5 and pool.n_free == 27
    tree.match(common + [5, 6, 7, 8])  # x (and the shared block) used last
    tree.lock(z)
    assert tree.evict(1) == 1  # y: the least recently used unlocked leaf
    assert tree.match(common + [9, 9, 9, 9])[0] == 4
    assert tree.evict(1) == 1  # x; its parent (the common block) is now a childless leaf...
    assert tree.evict(1) == 1  # ...and goes next: z is locked
    assert tree.match(common)[0] == 0 and tree.match([7] * 8)[0] == 8
    assert tree.evict(10) == 0  # only locked z is left
    tree.unlock(z)
    assert tree.evict(10) == 2 and pool.n_free == 32 and tree.n_blocks == 0
    with pytest.raises(ValueError):
        tree.unlock(z)


def test_radix_peek_is_match_without_touching_the_tree_and_evictable_counts_what_evict_frees():
    pool = BlockPool(32, BS)
    tree = RadixCache(pool)
    a = list(range(12))
    held = pool.alloc(3)
    tree.insert(a, held)  # a request still holds these (ref 2)
    b = a[:4] + [50, 51, 52, 53]
    own = pool.alloc(2)
    tree.insert(b, own)
    pool.decref(own)  # only the tree holds b's second block now (ref 1; its first is a's)
    top = tree.root.children[tuple(a[:4])]
    queries, clock, n_children = tree.stats.queries, top.last_use, len(top.children)
    expect = {tuple(a): 12, tuple(a[:7]): 4, tuple(b): 8, tuple(a[:8] + [0] * 4): 8, (9,) * 8: 0, (): 0}
    for tokens, n in expect.items():
        assert tree.peek(tokens) == n, tokens
    assert (tree.stats.queries, top.last_use, len(top.children)) == (queries, clock, n_children)  # untouched
    assert [tree.match(t)[0] for t in expect] == list(expect.values())  # what match finds (it splits, counts)
    assert tree.evictable() == 1  # b's own block: a's are shared with the request
    assert tree.evict(32) == 1 and tree.evictable() == 0
    pool.decref(held)  # the request ends: the tree alone holds a's blocks
    assert tree.evictable() == 3 and tree.evict(32) == 3 and pool.n_free == 32


def test_no_leak_after_1000_random_requests():
    rng = random.Random(0)
    pool = BlockPool(64, BS)
    m = BlockManager(pool)
    tree = RadixCache(pool)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    running: dict[int, tuple] = {}
    for rid in range(1000):
        prompt = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        n, blocks, node = tree.match(prompt)
        tree.lock(node)
        n_gen = rng.randrange(1, 10)
        need = pool.blocks_for(len(prompt) + n_gen) - len(blocks)
        while pool.n_free < need:  # finish the oldest requests, then evict, until it fits
            if running:
                finish(m, tree, running, next(iter(running)))
            elif tree.evict(need - pool.n_free) == 0:
                break
        if pool.n_free < need:
            tree.unlock(node)
            continue
        m.allocate(rid, len(prompt), prefix=blocks)
        m.append(rid, n_gen)
        if rng.random() < 0.3:
            m.truncate(rid, len(prompt) + rng.randrange(0, n_gen))  # a rejected draft rolled back
        running[rid] = (prompt, node)
        if rng.random() < 0.5:
            finish(m, tree, running, rid)
    for rid in list(running):
        finish(m, tree, running, rid)
    assert not m.tables
    tree.evict(pool.n_blocks)
    assert pool.n_free == pool.n_blocks and not pool.ref.any() and tree.n_blocks == 0
    assert tree.stats.hits > 500  # the shared system prompts were found


def finish(m: BlockManager, tree: RadixCache, running: dict, rid: int) -> None:
    prompt, node = running.pop(rid)
    t = m.tables[rid]
    tree.insert(prompt, t.blocks)  # the prompt's whole blocks stay cached
    tree.unlock(node)
    m.free(rid)
    assert (np.asarray(m.pool.ref) >= 0).all()
