"""hybrid serve with speculative decoding (--spec-type ngram): the same greedy replies as without it, llama-server's
draft_n / draft_n_accepted in the timings, the draft counters in /metrics, plain decoding for logprobs requests."""

from __future__ import annotations

import json

import pytest

from hybrid.generate.draft import NgramDrafter
from hybrid.generate.speculative import Speculator

from serve_helpers import engine_for, metrics, post, server

# an input the reply copies from: prompt lookup drafts most of it
COPY = ("Repeat this list exactly:\napple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, "
        "mango, nectarine, orange, papaya\nThe list again:\napple, banana,")


def _complete(url: str, **extra) -> dict:
    status, _, raw = post(url, "/v1/completions", {"prompt": COPY, "max_tokens": 24, "temperature": 0,
                                                   "cache_prompt": False, **extra})
    assert status == 200, raw
    return json.loads(raw)


@pytest.fixture(scope="module")
def engine(demo_model):
    return engine_for(str(demo_model), 512)


def test_speculative_server_matches_plain_and_reports_drafts(engine):
    with server(engine) as s:
        plain = _complete(s.url)
    assert "draft_n" not in plain["timings"]
    with server(engine) as s:
        s.state.speculator = Speculator(NgramDrafter(n=3, draft_max=8), draft_max=8, adaptive=False)
        spec = _complete(s.url)
        m = metrics(s.url)
        with_lp = _complete(s.url, logprobs=2)
        m2 = metrics(s.url)
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    t = spec["timings"]
    assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    assert m["hybrid_draft_tokens_total"] == t["draft_n"]
    assert m["hybrid_draft_tokens_accepted_total"] == t["draft_n_accepted"]
    # logprobs need each token's own logits: that request decodes plainly, its text the same
    assert "draft_n" not in with_lp["timings"] and with_lp["choices"][0]["text"] == plain["choices"][0]["text"]
    assert m2["hybrid_draft_tokens_total"] == m["hybrid_draft_tokens_total"]
