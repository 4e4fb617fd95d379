"""Speculative decoding: the n-gram drafter, exact verification against plain decoding, KV-cache rollback."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid.engine import Engine, EngineParams
from hybrid.generate.draft import NgramDrafter
from hybrid.generate.loop import generate
from hybrid.generate.sampling import SamplingParams
from hybrid.tools.bench_spec import CODE_PROMPT
from hybrid.generate.speculative import (LEARN_MAX, PROBE_BUDGET, PROBE_EVERY, DraftLength, SpecStats,
                                         generate_speculative)

GREEDY = SamplingParams(temp=0.0)
N_GEN = 48
TIE = 1e-3  # top-2 logits closer than this: batch-shape float differences may flip the argmax

REPETITIVE = CODE_PROMPT  # a class whose getters follow one pattern, continued after `def get_`


# -- the drafter, on hand-made sequences --------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_most_recent_match():
    d = NgramDrafter(n=3, draft_max=4)
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3]
    assert d.propose(seq) == [4, 5, 6, 7]  # the later [1 2 3] (followed by 4 5 6 7) wins over the first


def test_ngram_falls_back_to_shorter_suffixes_down_to_two():
    d = NgramDrafter(n=3, draft_max=8)
    assert d.propose([5, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1, 2, 3]  # [1 2 3] absent, [2 3] found
    assert d.propose([5, 3, 7, 8, 1, 2, 3]) == []  # only the 1-gram [3] matches: not tried when n > 1
    assert NgramDrafter(n=1).propose([5, 3, 7, 8, 1, 2, 3]) == [7, 8, 1, 2, 3]


def test_ngram_respects_draft_max_and_draft_min():
    seq = [1, 2, 3, 4, 1, 2]
    assert NgramDrafter(n=2, draft_max=1).propose(seq) == [3]
    assert NgramDrafter(n=2, draft_max=8, draft_min=2).propose(seq) == [3, 4, 1, 2]
    assert NgramDrafter(n=2, draft_max=8, draft_min=5).propose(seq) == []  # only 4 follow


def test_ngram_overlapping_repeat_and_no_match():
    assert NgramDrafter(n=2, draft_max=3).propose([7, 7, 7]) == [7]  # [7 7] at 0, one token follows it
    assert NgramDrafter(n=3).propose([1, 2, 3, 4, 5]) == []
    assert NgramDrafter(n=3).propose([1]) == []
    assert NgramDrafter(n=3).propose([]) == []


def test_draft_length_follows_measured_cost_and_acceptance():
    d = DraftLength(1, 8)
    assert d.choose() == 0  # a plain step is measured first
    d.observe(0, 0, 10.0)
    assert d.choose() == LEARN_MAX  # then a moderate draft, to measure a check's cost
    for _ in range(5):
        d.observe(4, 4, 12.0)  # cheap checks, all accepted
    assert d.choose() == 8
    slow = DraftLength(1, 8)
    slow.observe(0, 0, 10.0)
    for _ in range(10):
        slow.observe(4, 1, 10.0 + 4 * 6.0)  # each extra token costs 60 % of a step, acceptance low
    assert slow.choose() == 0  # speculation does not pay: off
    for _ in range(PROBE_EVERY):
        slow.observe(0, 0, 10.0)
    assert slow.choose() == 0  # a probe costs 0.6 of a step: not within 1 % of 32 steps...
    for _ in range(int(6.0 / (PROBE_BUDGET * 10.0)) - PROBE_EVERY):
        slow.observe(0, 0, 10.0)
    assert slow.choose() == 1  # ...but within 1 % of 60


def test_draft_length_keeps_to_the_allowed_lengths():
    d = DraftLength(1, 8, lengths=(1, 3, 7))
    d.observe(0, 0, 10.0)
    assert d.choose() == 3  # the longest allowed up to LEARN_MAX
    for _ in range(5):
        d.observe(3, 3, 11.0)
    assert d.choose() == 7
    assert DraftLength(2, 8, lengths=(1, 3, 7)).lengths == [3, 7]


# -- against the demo model ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(demo_model):
    e = Engine.load(demo_model, EngineParams(n_ctx=512, n_batch=512, n_ubatch=512))
    yield e
    e.close()


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return engine.tokenizer.encode(REPETITIVE, add_special=True, parse_special=True)


@pytest.fixture(scope="module")
def plain(engine, prompt_ids):
    """Plain greedy ids and, per step, whether the top-2 logits were a near-tie."""
    cache = engine.new_cache()
    logits = engine.eval(prompt_ids, cache)
    ids, ties = [], []
    for _ in range(N_GEN):
        top2 = np.partition(logits, -2)[-2:]
        ties.append(float(top2[1] - top2[0]) < TIE)
        ids.append(int(np.argmax(logits)))
        logits = engine.eval([ids[-1]], cache)
    return ids, ties


def test_greedy_speculative_equals_plain(engine, prompt_ids, plain):
    ids, ties = plain
    stats = SpecStats()
    spec = list(generate_speculative(engine, prompt_ids, GREEDY, N_GEN, engine.new_cache(),
                                     NgramDrafter(n=3, draft_max=8), draft_max=8, stats=stats, adaptive=False))
    # Plain greedy stops at an end-of-generation token; compare only what both produced, up to the first near-tie.
    agreed = next((i for i, t in enumerate(ties) if t), N_GEN)
    n = min(agreed, len(spec), len(ids))
    assert n >= 32, f"a near-tie at step {agreed} leaves too short a prefix to compare"
    assert spec[:n] == ids[:n]
    assert stats.drafted > 0 and stats.accepted > 0  # the getters' pattern is copied from the prompt
    assert stats.rate > 0.3, stats.as_dict()


def test_no_proposal_is_plain_decoding(engine, prompt_ids, plain):
    class Never:
        def propose(self, tokens, n_max):
            return []

    stats = SpecStats()
    out = list(generate_speculative(engine, prompt_ids, GREEDY, 8, engine.new_cache(), Never(), stats=stats))
    assert out == plain[0][:8] and stats.drafted == 0 and stats.steps == 7


def test_rollback_equals_never_evaluating_the_rejected_tokens(engine, prompt_ids):
    ref = engine.new_cache()
    engine.eval(prompt_ids, ref)
    cont = [int(t) for t in engine.tokenizer.encode("x(self):", add_special=False)]
    want = engine.eval(cont, ref, logits_from=0)

    cache = engine.new_cache()
    engine.eval(prompt_ids, cache)
    junk = [int(t) for t in engine.tokenizer.encode(" banana split with cherries on top", add_special=False)]
    engine.eval(junk, cache, logits_from=0)  # evaluated, then rejected
    cache.n_past = len(prompt_ids)
    got = engine.eval(cont, cache, logits_from=0)
    assert cache.n_past == ref.n_past
    np.testing.assert_array_equal(got, want)  # same batch shape both ways: bit for bit


def test_seeded_sampling_matches_plain(engine, prompt_ids):
    """Each emitted token costs one draw, so with a seed speculative sampling retraces plain sampling."""
    params = SamplingParams(temp=0.8, seed=1234)
    plain_ids = list(generate(engine, prompt_ids, params, 24, engine.new_cache()))
    spec = list(generate_speculative(engine, prompt_ids, params, 24, engine.new_cache(), NgramDrafter(),
                                     adaptive=False))
    assert spec[:16] == plain_ids[:16]


def test_respects_n_predict_and_context(engine, prompt_ids):
    stats = SpecStats()
    out = list(generate_speculative(engine, prompt_ids, GREEDY, 5, engine.new_cache(), NgramDrafter(), stats=stats))
    assert len(out) == 5
    cache = engine.new_cache(len(prompt_ids) + 6)
    out = list(generate_speculative(engine, prompt_ids, GREEDY, -1, cache, NgramDrafter()))
    assert len(out) <= 7 and cache.n_past <= cache.n_ctx


def test_eval_rows_equals_eval_and_skips_unread_rows(engine, prompt_ids):
    cont = [int(t) for t in engine.tokenizer.encode(" get_z(self):\n        return", add_special=False)]
    ref = engine.new_cache()
    engine.eval(prompt_ids, ref)
    want = engine.eval(cont, ref, logits_from=0)
    cache = engine.new_cache()
    engine.eval(prompt_ids, cache)
    rows = engine.eval_rows(cont, cache)
    assert cache.n_past == ref.n_past and len(rows) == len(cont) and rows.computed == 0
    np.testing.assert_array_equal(rows[1], want[1])  # the CPU's integer dots: a row alone = the row in a batch
    assert rows.computed == 2  # rows are computed in order, as far as read
    np.testing.assert_array_equal(rows[-1], want[-1])
    assert rows.computed == len(cont) and rows.ms > 0
    with pytest.raises(IndexError):
        rows[len(cont)]
