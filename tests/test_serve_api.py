"""hybrid serve over HTTP with a real model (SmolLM2-135M-Instruct) and the openai client: chat and text
completions, streamed and not, the SSE framing, stop strings, logprobs, prompt caching, tokenize, metrics."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")

from serve_helpers import engine_for, get, metrics, post, server, sse  # noqa: E402

HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def srv(smollm2_model):
    with server(engine_for(str(smollm2_model))) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_health_and_models(srv, client):
    status, _, body = get(srv.url, "/health")
    assert status == 200 and b'"ok"' in body
    assert [m.id for m in client.models.list().data] == ["test-model"]


def test_chat_non_stream_greedy_matches_stream_and_cache(client):
    kw = dict(model="test-model", messages=HELLO, max_tokens=12, temperature=0)
    a = client.chat.completions.create(**kw, extra_body={"cache_prompt": False}, logprobs=True)
    assert a.object == "chat.completion" and a.choices[0].message.role == "assistant"
    assert a.choices[0].finish_reason in ("stop", "length") and a.choices[0].message.content
    assert 0 < a.usage.completion_tokens <= 12 and a.usage.prompt_tokens > 5
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    b = client.chat.completions.create(**kw, logprobs=True)  # the same prompt: all but its last token cached
    assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - 1
    assert b.model_extra["timings"]["cache_n"] == b.usage.prompt_tokens - 1
    assert b.model_extra["timings"]["prompt_n"] == 1
    # The last prompt token alone rather than in a batch moves the logits slightly (batch shape), so texts may
    # part after a while; the first token and its log-prob must agree (stale or misplaced K/V would not).
    la, lb = a.choices[0].logprobs.content[0], b.choices[0].logprobs.content[0]
    assert la.token == lb.token and abs(la.logprob - lb.logprob) < 0.1
    chunks = list(client.chat.completions.create(**kw, stream=True))  # the same path as b: the same text
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == b.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == b.choices[0].finish_reason


def test_sse_framing(srv):
    body = {"messages": HELLO, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse(srv.url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1] if c["choices"])
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0] is chunks[-2] and finals[0]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])
    plain = sse(srv.url, "/v1/chat/completions", {**body, "stream_options": None})
    assert all("usage" not in c for c in plain[:-1]) and plain[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_stream_and_not(client, srv):
    a = client.completions.create(model="x", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert a.object == "text_completion" and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 6 and a.choices[0].text
    chunks = list(client.completions.create(model="x", prompt="The capital of France is", max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == a.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    ids = post(srv.url, "/tokenize", {"content": "The capital of France is", "add_special": True})
    import json
    tokens = json.loads(ids[2])["tokens"]
    b = client.completions.create(model="x", prompt=tokens, max_tokens=6, temperature=0)
    assert b.choices[0].text == a.choices[0].text  # token ids in, same greedy text out


def test_stop_string_cuts_and_never_leaks(client):
    kw = dict(model="x", prompt="The capital of France is", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2][:3]  # a stop string inside the third word
    cut = full[: full.index(stop)]
    a = client.completions.create(**kw, stop=[stop, "zzzz"])
    assert a.choices[0].text == cut and a.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == cut


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="x", messages=HELLO, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert e.top_logprobs[0].token == e.token and e.logprob == pytest.approx(tops[0])  # greedy: the top one
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_seed_makes_sampling_repeatable(client):
    kw = dict(model="x", messages=HELLO, max_tokens=10, temperature=1.0, seed=1234)
    assert client.chat.completions.create(**kw).choices[0].message.content == \
        client.chat.completions.create(**kw).choices[0].message.content


def test_next_chat_turn_reuses_the_cache(client):
    first = client.chat.completions.create(model="x", messages=HELLO, max_tokens=8, temperature=0)
    turn2 = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And one about the sky."}]
    second = client.chat.completions.create(model="x", messages=turn2, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # at least the whole first prompt came from the cache
    t = second.model_extra["timings"]
    assert t["cache_n"] == cached and t["prompt_n"] == second.usage.prompt_tokens - cached


def test_tokenize_detokenize_round_trip(srv):
    import json

    status, _, raw = post(srv.url, "/tokenize", {"content": "Hello 你好 🎉", "with_pieces": True})
    assert status == 200
    toks = json.loads(raw)["tokens"]
    assert all(set(t) == {"id", "piece"} for t in toks)
    status, _, raw = post(srv.url, "/detokenize", {"tokens": [t["id"] for t in toks]})
    assert status == 200 and json.loads(raw)["content"] == "Hello 你好 🎉"
    status, _, raw = post(srv.url, "/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and b"outside the vocabulary" in raw


def test_metrics_count_requests(srv, client):
    before = metrics(srv.url)
    client.chat.completions.create(model="x", messages=HELLO, max_tokens=3, temperature=0)
    after = metrics(srv.url)
    assert after["hybrid_requests_total"] == before["hybrid_requests_total"] + 1
    assert after["hybrid_tokens_predicted_total"] == before["hybrid_tokens_predicted_total"] + 3
    assert after["hybrid_prompt_cache_hits_total"] >= before["hybrid_prompt_cache_hits_total"]
    assert after["hybrid_requests_processing"] == 0 and after["hybrid_requests_deferred"] == 0
    assert after["hybrid_n_ctx"] == 2048 and after["hybrid_predicted_tokens_seconds"] > 0
