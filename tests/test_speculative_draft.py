"""Speculative decoding with a draft model (-md), the vocabulary check, the Speculator across calls, and a χ² test
that verification keeps the target's sampling distribution at temperature > 0."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import chi2

from hybrid.engine import Engine, EngineParams
from hybrid.generate.draft_model import ModelDrafter, VocabMismatch, check_vocab
from hybrid.generate.loop import generate
from hybrid.generate.sampling import SamplingParams, apply_penalties
from hybrid.generate.speculative import SpecStats, Speculator, generate_speculative
from hybrid.tools.synth.model import ModelShape, make_model

GREEDY = SamplingParams(temp=0.0)
TINY = ModelShape(n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=128, n_vocab=300)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "tiny-llama-f32.gguf"
    make_model(path, "llama", TINY, "F32", seed=7)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_path):
    e = Engine.load(tiny_path, EngineParams(n_ctx=64, n_batch=64, n_ubatch=64))
    yield e
    e.close()


@pytest.fixture(scope="module")
def demo(demo_model):
    e = Engine.load(demo_model, EngineParams(n_ctx=512, n_batch=512, n_ubatch=512))
    yield e
    e.close()


# -- the vocabulary check -----------------------------------------------------------------------------------------

def _tokenizer_with(tok, **changes):
    other = copy.copy(tok)
    other.vocab = copy.copy(tok.vocab)
    for name, value in changes.items():
        setattr(other.vocab, name, value)
    return other


def test_same_vocabulary_passes(demo):
    check_vocab(demo.tokenizer, demo.tokenizer)


def test_a_differing_token_is_named(demo):
    tokens = list(demo.tokenizer.vocab.tokens)
    tokens[1000] = "something else"
    with pytest.raises(VocabMismatch, match=r"at token 1000: .* in the target, 'something else' in the draft"):
        check_vocab(demo.tokenizer, _tokenizer_with(demo.tokenizer, tokens=tokens))


def test_padding_differences_are_allowed(demo):
    v = demo.tokenizer.vocab
    pads = [i for i in range(v.n_tokens) if v.tokens[i].startswith("<unused")]
    assert pads, "the demo vocabulary has <unusedN> slots"
    tokens = list(v.tokens)
    tokens[pads[0]] = "[PAD0]"
    check_vocab(demo.tokenizer, _tokenizer_with(demo.tokenizer, tokens=tokens))
    assert all(t.startswith("<unused") for t in v.tokens[-8:])
    shorter = _tokenizer_with(demo.tokenizer, tokens=list(v.tokens[:-8]), token_types=v.token_types[:-8])
    check_vocab(demo.tokenizer, shorter)  # padding slots at the end may be missing from the draft
    real = _tokenizer_with(demo.tokenizer, tokens=list(v.tokens[:-8]) + [f"word{i}" for i in range(8)],
                           token_types=np.concatenate([v.token_types[:-8], np.ones(8, np.int32)]))
    with pytest.raises(VocabMismatch, match=r"at token \d+: 'word0' only in the target"):
        check_vocab(real, shorter)


def test_bos_and_kind_mismatch(demo, tiny):
    with pytest.raises(VocabMismatch, match="BOS"):
        check_vocab(demo.tokenizer, _tokenizer_with(demo.tokenizer, bos=7))
    with pytest.raises(VocabMismatch):
        check_vocab(demo.tokenizer, tiny.tokenizer)


# -- the draft model ----------------------------------------------------------------------------------------------

def test_model_drafter_drafts_greedily_and_follows_rollback(tiny):
    d = ModelDrafter(tiny, tiny.config.n_vocab, p_min=0.0)
    seq = [1, 290, 280, 270]
    first = d.propose(seq, 4)
    assert len(first) == 4 and d.cache.n_past == len(seq) + 3  # the last drafted token is not evaluated
    # the reference: plain greedy decoding from seq
    ref = list(generate(tiny, seq, GREEDY, 4, tiny.new_cache()))
    assert first == ref
    # the target accepted 2 of them, then chose its own token: the drafter keeps the accepted prefix only
    seq2 = seq + first[:2] + [5]
    again = d.propose(seq2, 3)
    assert d.cache.n_past == len(seq2) + 2
    fresh = ModelDrafter(tiny, tiny.config.n_vocab, p_min=0.0).propose(seq2, 3)
    assert again == fresh
    assert d.propose(seq2, 0) == [] and d.propose([], 3) == []


def test_model_drafter_stops_below_p_min(tiny):
    d = ModelDrafter(tiny, tiny.config.n_vocab, p_min=1.0)
    assert d.propose([1, 290, 280], 4) == []  # no token is certain


def test_self_draft_greedy_equals_plain_with_high_acceptance(demo):
    prompt = demo.tokenizer.encode("The capital of France is", add_special=True)
    plain = list(generate(demo, prompt, GREEDY, 24, demo.new_cache()))
    stats = SpecStats()
    drafter = ModelDrafter(demo, demo.config.n_vocab, p_min=0.0)
    spec = list(generate_speculative(demo, prompt, GREEDY, 24, demo.new_cache(), drafter, draft_max=4,
                                     stats=stats, adaptive=False))
    n = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    assert n >= 16, (plain, spec)  # the same model drafts: only batch-shape float sums can part them
    assert stats.drafted > 0 and stats.rate > 0.9, stats.as_dict()


def test_speculator_keeps_totals_and_draft_length_across_calls(tiny):
    spec = Speculator(ModelDrafter(tiny, tiny.config.n_vocab, p_min=0.0), draft_max=3)
    one, two = SpecStats(), SpecStats()
    a = list(spec.generate(tiny, [1, 290, 280], GREEDY, 12, tiny.new_cache(), stats=one))
    cache = tiny.new_cache()
    tiny.eval([1, 290], cache)  # a prefix the cache already holds (a chat's earlier turn)
    b = list(spec.generate(tiny, [280], GREEDY, 12, cache, prefix=[1, 290], stats=two))
    assert a == b == list(generate(tiny, [1, 290, 280], GREEDY, 12, tiny.new_cache()))
    assert spec.stats.steps == one.steps + two.steps and spec.stats.drafted == one.drafted + two.drafted
    assert spec.length.t1 is not None  # measured in the first call, kept for the second


# -- the distribution at temperature > 0 --------------------------------------------------------------------------

class FixedDrafter:
    """Drafts the token most likely to follow under the target, so both acceptance and rejection are frequent."""

    def __init__(self, table: dict[int, int]):
        self.table = table

    def propose(self, tokens, n_max):
        return [self.table[tokens[-1]]][:n_max]


def test_chi2_first_two_tokens_keep_the_target_distribution(tiny):
    """10,000 seeded generations of 2 tokens after a fixed context with one drafted token each: the joint counts
    of (t1, t2) against the exact probabilities (the target's logits through the same sampler chain), χ² p > 0.01."""
    params = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5, repeat_last_n=64)
    prompt = [1, 290, 280, 270, 260]
    cache = tiny.new_cache()
    logits0 = tiny.eval(prompt, cache)
    p1 = _probs(logits0, prompt, SamplingParams(**params))
    joint, table = {}, {}
    for t1 in np.flatnonzero(p1 > 1e-6):
        cache.n_past = len(prompt)
        l1 = tiny.eval([int(t1)], cache)
        p2 = _probs(l1, prompt + [int(t1)], SamplingParams(**params))
        table[int(t1)] = int(np.argmax(p2))
        for t2 in np.flatnonzero(p2 > 1e-9):
            joint[(int(t1), int(t2))] = p1[t1] * p2[t2]

    n = 10_000
    counts: dict[tuple[int, int], int] = {}
    stats = SpecStats()
    drafter = FixedDrafter(table)
    for seed in range(n):
        cache.n_past = 0
        out = list(generate_speculative(tiny, prompt, SamplingParams(**params, seed=seed), 3, cache, drafter,
                                        draft_max=1, stats=stats, adaptive=False))
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    assert 0.1 < stats.rate < 0.9, stats.as_dict()  # both branches of the verification were taken often

    expected = {k: v * n for k, v in joint.items()}
    big = [k for k, e in expected.items() if e >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [expected[k] for k in big] + [n - sum(expected[k] for k in big)]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    p = chi2.sf(stat, len(obs) - 1)
    assert len(big) >= 20, len(big)
    assert p > 0.01, (stat, len(obs), p)


def _probs(logits, history, params: SamplingParams) -> np.ndarray:
    """The sampler's exact distribution for this chain (top-k, top-p and min-p off): penalties, temperature."""
    z = apply_penalties(logits, history, params).astype(np.float64) / params.temp
    e = np.exp(z - z.max())
    return e / e.sum()


# -- the command line ---------------------------------------------------------------------------------------------

def _hybrid(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "hybrid", *args], capture_output=True, text=True, timeout=timeout)


def test_run_with_a_draft_model_reports_its_stats(demo_model):
    r = _hybrid("run", str(demo_model), "-p", "The capital of France is", "-n", "12", "--temp", "0", "-c", "256",
                "-md", str(demo_model), "--draft-max", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["generated_ids"]) == 12 and out["speculative"]["steps"] > 0


def test_mismatched_draft_vocabulary_is_one_line(demo_model, tiny_path):
    r = _hybrid("run", str(demo_model), "-p", "Hi", "-n", "4", "-c", "256", "-md", str(tiny_path))
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error")]
    assert len(lines) == 1 and "draft model" in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, words", [
    (["--spec-type", "ngram", "-md", "X"], "two drafters"),
    (["--spec-type", "draft"], "needs a draft model"),
    (["--spec-type", "nope"], "give one of"),
    (["--draft-p-min", "1.5"], "probability"),
])
def test_spec_usage_errors(demo_model, args, words):
    r = _hybrid("run", str(demo_model), "-p", "Hi", "-n", "1", *args, timeout=60)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_bench_spec_sweep_rows(demo_model):
    r = _hybrid("bench", str(demo_model), "-p", "0", "-n", "8", "-r", "1", "--spec-type", "none,ngram",
                "--draft-max", "2,4", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["spec_type"], x["draft_max"]) for x in rows] == [("none", 0), ("ngram", 2), ("ngram", 4)]
    assert all(x["test"] == "tg8" and x["avg_ts"] > 0 for x in rows)
    assert rows[2]["n_drafted"] > 0 and 0 <= rows[2]["acceptance_rate"] <= 1 and rows[2]["acceptance_at"]
    bad = _hybrid("bench", str(demo_model), "-n", "8", "--spec-type", "draft", timeout=60)
    assert bad.returncode == 2 and "needs a draft model" in bad.stderr
