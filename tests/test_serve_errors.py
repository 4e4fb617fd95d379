"""Bad input gets a clear 4xx in OpenAI's error shape, never a traceback; the API key guards every route but
/health and the page."""

from __future__ import annotations

import json

import pytest

from serve_helpers import ScriptedModel, engine_for, get, post, server  # noqa: E402

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(smollm2_model):
    return engine_for(str(smollm2_model))


@pytest.fixture(scope="module")
def srv(engine):
    with server(engine, ScriptedModel(engine.tokenizer.encode("fine", add_special=False))) as s:
        yield s


def error(status_raw) -> tuple[int, dict]:
    status, _, raw = status_raw
    body = json.loads(raw)
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    assert "Traceback" not in body["error"]["message"]
    return status, body["error"]


@pytest.mark.parametrize("raw,words", [
    (b'{"messages": [', "not valid JSON"),
    (b"", "empty"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b'"just a string"', "JSON object"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "'temperature' must be a number"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "'max_tokens' must be at least 1"),
    (b'{"messages": []}', "'messages' is empty"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 3}', "'n' must be 1"),
])
def test_malformed_requests_are_400(srv, raw, words):
    status, err = error(post(srv.url, "/v1/chat/completions", raw))
    assert status == 400 and words in err["message"] and err["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored(srv):
    status, _, raw = post(srv.url, "/v1/chat/completions", {"messages": ASK, "frobnicate": [1, {"x": None}],
                                                            "user": "me", "metadata": {"a": "b"}})
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "fine"


def test_prompt_longer_than_the_context(srv, engine):
    long = "word " * 3000
    n = len(engine.tokenizer.encode(long, add_special=True, parse_special=True))
    status, err = error(post(srv.url, "/v1/completions", {"prompt": long}))
    assert status == 400 and f"the prompt is {n} tokens and the context 2048" in err["message"]
    status, err = error(post(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}))
    assert status == 400 and "context 2048" in err["message"] and err["param"] == "messages"


def test_a_10_mb_body_is_413_and_the_server_goes_on(srv):
    big = b'{"prompt": "' + b"a" * (10 << 20) + b'"}'
    status, err = error(post(srv.url, "/v1/completions", big))
    assert status == 413 and "more than the limit" in err["message"]
    status, _, _ = post(srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 200


def test_unknown_route_and_method(srv):
    status, err = error(get(srv.url, "/v1/nothing"))
    assert status == 404 and "no such route" in err["message"]
    status, err = error(get(srv.url, "/v1/chat/completions"))
    assert status == 405


def test_bad_token_ids_and_types(srv):
    status, err = error(post(srv.url, "/v1/completions", {"prompt": [1, 2, 10 ** 8]}))
    assert status == 400 and "outside the vocabulary" in err["message"]
    status, err = error(post(srv.url, "/tokenize", {"content": 5}))
    assert status == 400 and "'content' must be a string" in err["message"]


def test_api_key(engine):
    m = ScriptedModel(engine.tokenizer.encode("ok", add_special=False))
    with server(engine, m, api_key="s3cret") as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"X-Api-Key": "nope"}):
            status, err = error(post(s.url, "/v1/chat/completions", {"messages": ASK}, headers))
            assert status == 401 and err["type"] == "authentication_error"
            for path in ("/v1/models", "/metrics", "/props"):
                assert get(s.url, path, headers)[0] == 401
            assert post(s.url, "/tokenize", {"content": "x"}, headers)[0] == 401
        assert get(s.url, "/health")[0] == 200  # open, as llama-server's
        assert get(s.url, "/")[0] == 200  # the page: static, it asks for the key
        assert m.started == 0  # nothing was generated for a refused request
        for headers in ({"Authorization": "Bearer s3cret"}, {"X-Api-Key": "s3cret"}):
            status, _, raw = post(s.url, "/v1/chat/completions", {"messages": ASK}, headers)
            assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "ok"
        openai = pytest.importorskip("openai")
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == "test-model"
