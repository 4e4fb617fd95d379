"""Sampling: greedy, top-k without a full sort, top-p, min-p, temperature, penalties, seeds."""

from __future__ import annotations

import numpy as np

from hybrid.generate.sampling import Sampler, SamplingParams, apply_penalties, log_softmax, top_k


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams(temp=0)).sample(logits) == 1


def test_top_k_sorted_with_ties_by_id():
    logits = np.array([1.0, 5.0, 3.0, 5.0, 2.0], dtype=np.float32)
    ids, vals = top_k(logits, 3)
    assert ids.tolist() == [1, 3, 2] and vals.tolist() == [5.0, 5.0, 3.0]
    ids, _ = top_k(logits, 0)
    assert ids.tolist() == [1, 3, 2, 4, 0]


def test_top_k_1_and_min_p_restrict_choices():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32)
    best = int(np.argmax(logits))
    s = Sampler(SamplingParams(temp=1.0, top_k=1, seed=3))
    assert all(s.sample(logits) == best for _ in range(20))
    logits2 = np.full(1000, -10.0, dtype=np.float32)
    logits2[[7, 9]] = [5.0, 4.9]
    s = Sampler(SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=1))
    assert {s.sample(logits2) for _ in range(50)} <= {7, 9}


def test_top_p_keeps_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    s = Sampler(SamplingParams(temp=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=0))
    assert {s.sample(logits) for _ in range(200)} == {0, 1}


def test_same_seed_same_tokens_and_distribution():
    logits = np.log(np.array([0.6, 0.3, 0.1])).astype(np.float32)
    p = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a = [Sampler(p).sample(logits) for _ in range(1)]
    s1, s2 = Sampler(p), Sampler(p)
    seq1 = [s1.sample(logits) for _ in range(300)]
    seq2 = [s2.sample(logits) for _ in range(300)]
    assert seq1 == seq2 and a[0] == seq1[0]
    freq = np.bincount(seq1, minlength=3) / 300
    assert np.allclose(freq, [0.6, 0.3, 0.1], atol=0.08)


def test_penalties_as_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    p = SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, repeat_last_n=64)
    out = apply_penalties(logits, [0, 1, 1], p)
    assert np.allclose(out, [2.0 / 2 - 0.25 - 0.5, -2.0 * 2 - 0.5 - 0.5, 1.0])
    assert apply_penalties(logits, [0], SamplingParams()) is logits  # all off: untouched


def test_log_softmax_normalized():
    x = np.random.default_rng(1).normal(size=(3, 50)).astype(np.float32) * 10
    assert np.allclose(np.exp(log_softmax(x)).sum(-1), 1.0)


def test_argmax_only_where_greedy_draws_are_the_raw_logits_argmax():
    """Sampler.argmax_only: greedy with no penalty that would change the logits (the engine may then hand over the
    id alone); its draws are then np.argmax of the logits as given."""
    assert Sampler(SamplingParams(temp=0)).argmax_only
    assert Sampler(SamplingParams(temp=0, repeat_penalty=1.3, repeat_last_n=0)).argmax_only
    assert not Sampler(SamplingParams(temp=0.8)).argmax_only
    assert not Sampler(SamplingParams(temp=0, repeat_penalty=1.3)).argmax_only
    assert not Sampler(SamplingParams(temp=0, presence_penalty=0.5)).argmax_only
    assert not Sampler(SamplingParams(temp=0, frequency_penalty=0.5)).argmax_only
    rng = np.random.default_rng(2)
    s = Sampler(SamplingParams(temp=0))
    for _ in range(20):
        logits = rng.standard_normal(500).astype(np.float32)
        assert s.sample(logits, list(rng.integers(0, 500, 30))) == int(np.argmax(logits))
