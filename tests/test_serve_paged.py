"""Continuous batching over one paged KV cache (hybrid.server.paged_scheduler): greedy tokens equal to the
contiguous slots' for the same step plan, a shared prompt prefix taken from the radix cache (not evaluated, not
copied), preemption when the pool runs short (the stopped sequences recomputed, their tokens unchanged), blocks
all back after many random requests, and `hybrid serve -np 4` on it over HTTP (/metrics counts the prefix cache).

Tolerance: as tests/test_serve_batched.py says, steps of fewer than 64 rows run the same integer dots per row
whatever else is in the batch, and the paged attention reads whole tiles of 32 keys from blocks of 32 or 64 as the
contiguous cache does, so the tokens are asserted equal to the slot scheduler's with the same budget."""

from __future__ import annotations

import json
import random

import pytest

from hybrid.server.paged_scheduler import PagedScheduler
from hybrid.server.prompt_cache import common_prefix
from hybrid.server.scheduler import BatchScheduler, Request

from serve_helpers import engine_for, metrics, post, server  # noqa: E402
from test_serve_batched import GREEDY, TEXTS  # noqa: E402


@pytest.fixture(scope="module")
def engine(smollm2_model):
    return engine_for(str(smollm2_model))


def _run(sched, prompts, n_predict, budget_of=None):
    """Every prompt through the scheduler, admitted as slots free up -> each one's tokens."""
    out: dict[int, list[int]] = {}
    index: dict[int, int] = {}
    pending = list(range(len(prompts)))
    while pending or sched.running or getattr(sched, "preempted", ()):
        while pending and sched.free_slots:
            i = pending.pop(0)
            n = n_predict if budget_of is None else budget_of(i)
            index[id(sched.admit(Request(prompts[i], GREEDY, n)))] = i
        for ev in sched.step():
            if ev.token is not None:
                out.setdefault(index[id(ev.seq)], []).append(ev.token)
    return [out.get(i, []) for i in range(len(prompts))]


def _system(engine):
    text = ("You are a helpful assistant who answers in short sentences about the history of science, art and the "
            "sea, and who never uses more words than the question needs. Keep to facts; say when you do not know. ")
    return engine.tokenizer.encode(text * 2, add_special=True)


def test_paged_scheduler_gives_the_slot_schedulers_tokens(engine):
    prompts = [engine.tokenizer.encode(t, add_special=True) for t in TEXTS]
    ref = _run(BatchScheduler(engine, 4, 8, 256), prompts, 24)
    sched = PagedScheduler(engine, 4, 8, 256, 1024, block_size=32)
    assert sched.warm_up() == 0  # the CPU replays no graphs: nothing to capture
    assert _run(sched, prompts, 24) == ref
    assert sched.free_slots == 4 and sched.busy_cells == 0 and sched.preemptions == 0
    pool = sched.kv.pool
    assert pool.n_free + sched.radix.n_blocks == pool.n_blocks  # what no sequence holds is free or cached
    assert sched.radix.evict(pool.n_blocks) == pool.n_blocks - pool.n_free or pool.n_free == pool.n_blocks
    assert pool.n_free == pool.n_blocks


def test_a_shared_system_prompt_is_taken_from_the_prefix_cache(engine):
    """The first request's prompt blocks enter the tree when its prefill ends; the three admitted after it adopt
    them, copy the rows of the shared part of the next block from it, evaluate only their own tails, and still give
    the tokens of the slot scheduler."""
    system = _system(engine)
    assert len(system) >= 64
    prompts = [system + engine.tokenizer.encode(t, add_special=False) for t in TEXTS[:4]]
    ref = _run(BatchScheduler(engine, 1, 16, 512), prompts, 10)
    sched = PagedScheduler(engine, 4, 16, 512, 2048, block_size=32)
    first = sched.admit(Request(prompts[0], GREEDY, 10))
    assert not sched.waits_for_prefix(prompts[1]) or first.remaining  # it waits while the prefix is evaluated
    assert sched.waits_for_prefix(prompts[1])
    out = {0: []}
    seqs = {id(first): 0}
    while first.remaining:
        for ev in sched.step():
            out[0] += [ev.token] if ev.token is not None else []
    assert not sched.waits_for_prefix(prompts[1])
    shared = len(system) // 32 * 32  # whole blocks, by reference
    held = {}
    for i in (1, 2, 3):
        seq = sched.admit(Request(prompts[i], GREEDY, 10))
        held[i] = min(common_prefix(prompts[0], prompts[i]), len(prompts[i]) - 1)  # the rest: rows copied
        assert seq.n_cached == held[i] > shared
        assert seq.cache.blocks[: shared // 32] == first.cache.blocks[: shared // 32]
        assert seq.cache.blocks[shared // 32] != first.cache.blocks[shared // 32]
        seqs[id(seq)] = i
        out[i] = []
    while sched.running:
        for ev in sched.step():
            if ev.token is not None:
                out[seqs[id(ev.seq)]].append(ev.token)
    assert [out[i] for i in range(4)] == ref
    assert sched.reused_tokens == sum(held.values()) and sched.copied_tokens == sum(held.values()) - 3 * shared
    assert sched.evaluated_tokens == len(prompts[0]) + sum(len(prompts[i]) - held[i] for i in held)
    assert sched.radix.stats.hits >= 3


def test_preemption_recomputes_and_keeps_every_token(engine):
    """A pool of 10 blocks of 32 for four sequences of up to ~90 positions: the newest are stopped and resumed
    (their prompt and reply recomputed, partly from the prefix cache), and every reply is the slot scheduler's."""
    prompts = [engine.tokenizer.encode(t, add_special=True) for t in TEXTS[:6]]
    ref = _run(BatchScheduler(engine, 1, 8, 256), prompts, 80)
    sched = PagedScheduler(engine, 4, 8, 256, 10 * 32, block_size=32)
    assert sched.kv.pool.n_blocks == 10
    assert _run(sched, prompts, 80) == ref
    assert sched.preemptions > 0
    assert sched.free_slots == 4 and not sched.preempted
    pool = sched.kv.pool
    sched.radix.evict(pool.n_blocks)
    assert pool.n_free == pool.n_blocks and (pool.ref == 0).all()


def test_no_block_leaks_after_random_requests_and_cancels(engine):
    rng = random.Random(4)
    words = ["sea", "art", "time", "the", "of", "and", "water", "fox", "capital", "one"]
    base = engine.tokenizer.encode("A story: ", add_special=True)
    sched = PagedScheduler(engine, 4, 16, 128, 8 * 32, block_size=32)
    live = []
    for step in range(120):
        if sched.free_slots and rng.random() < 0.5:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
            live.append(sched.admit(Request(base + engine.tokenizer.encode(text, add_special=False), GREEDY,
                                            rng.randint(1, 30))))
        if live and rng.random() < 0.08:  # a client leaves
            seq = live.pop(rng.randrange(len(live)))
            if seq in sched.running or seq in sched.preempted:
                sched.release(seq)
        for ev in sched.step():
            if ev.finish is not None and ev.seq in live:
                live.remove(ev.seq)
    for seq in live:
        if seq in sched.running or seq in sched.preempted:
            sched.release(seq)
    pool = sched.kv.pool
    assert not sched.running and not sched.preempted
    assert pool.n_free + sched.radix.n_blocks == pool.n_blocks
    sched.radix.evict(pool.n_blocks)
    assert pool.n_free == pool.n_blocks and (pool.ref == 0).all()


def test_serve_np4_runs_on_the_paged_cache(engine):
    """Every layer on the CPU: -np 4 batches over one paged pool (the -c cells in blocks of 64); a repeated prompt
    is a prefix-cache hit and the blocks come back when the requests end. (The two replies are not compared: the
    first evaluates its 90-token prompt in one float32 GEMM, the second only the tail past the cached block, in
    integer dots: a reply may part there, as the module docstring of test_serve_batched says.)"""
    body = {"prompt": " ".join(TEXTS) * 3, "max_tokens": 8, "temperature": 0}
    with server(engine, n_parallel=4) as s:
        assert isinstance(s.state.scheduler, PagedScheduler)
        replies = []
        for _ in range(2):
            status, _, raw = post(s.url, "/v1/completions", body)
            assert status == 200, raw
            replies.append(json.loads(raw))
        m = metrics(s.url)
    assert [r["usage"]["completion_tokens"] for r in replies] == [8, 8]
    assert m["hybrid_kv_blocks_total"] == engine.params.n_ctx // 64
    assert m["hybrid_prefix_cache_queries"] >= 2 and m["hybrid_prefix_cache_hit_tokens"] >= 64
    assert m["hybrid_slots_busy"] == 0 and m["hybrid_kv_cache_busy_cells"] == 0
    assert m["hybrid_prefix_cache_blocks"] >= 1  # the repeated prompt's block, kept for reuse
    assert m["hybrid_kv_blocks_free"] + m["hybrid_prefix_cache_blocks"] == m["hybrid_kv_blocks_total"]
