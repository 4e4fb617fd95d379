"""Streaming and reply parsing over HTTP with a scripted model (the real tokenizer and template, the reply's
tokens fixed): UTF-8 never split, stop strings never leaked, tool calls in both forms, reasoning_content, and
template errors as 400."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")

from serve_helpers import ScriptedModel, engine_for, post, server, sse  # noqa: E402

ASK = [{"role": "user", "content": "hi"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def engine(smollm2_model):
    return engine_for(str(smollm2_model))


@pytest.fixture(scope="module")
def model():
    return ScriptedModel()


@pytest.fixture(scope="module")
def srv(engine, model):
    with server(engine, model) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def script(model, engine, text: str) -> list[int]:
    model.reply = engine.tokenizer.encode(text, add_special=False)
    return model.reply


def test_multibyte_characters_never_split(srv, model, engine):
    text = "Emoji 🎉🐍 and 日本語のテキスト, café."
    ids = script(model, engine, text)
    partial = [i for i in ids if "\ufffd" in engine.tokenizer.decode([i])]
    assert partial, "the script should hold tokens that are parts of a character"
    for path, body, get in (("/v1/chat/completions", {"messages": ASK, "stream": True},
                             lambda c: c["choices"][0]["delta"].get("content") or ""),
                            ("/v1/completions", {"prompt": "x", "stream": True}, lambda c: c["choices"][0]["text"])):
        chunks = [c for c in sse(srv.url, path, body)[:-1] if c["choices"]]
        pieces = [get(c) for c in chunks]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == text


def test_stop_string_spanning_tokens_never_leaks_in_a_stream(srv, model, engine):
    script(model, engine, "alpha beta STOPWORD gamma")
    for stop in ("STOPWORD", ["xyz", "OPW"], " beta S"):
        chunks = sse(srv.url, "/v1/completions", {"prompt": "x", "stream": True, "stop": stop})
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"])
        first = min((("alpha beta STOPWORD gamma".index(s)) for s in ([stop] if isinstance(stop, str) else stop)
                     if s in "alpha beta STOPWORD gamma"))
        assert text == "alpha beta STOPWORD gamma"[:first]
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_hermes_tool_call(client, model, engine):
    script(model, engine, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    r = client.chat.completions.create(model="x", messages=ASK, tools=WEATHER)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    call = r.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = engine.tokenizer.decode(model.prompts[-1])
    assert "get_weather" in prompt and "<tool_call>" in prompt  # the template without tool support got them told
    chunks = list(client.chat.completions.create(model="x", messages=ASK, tools=WEATHER, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # the call's text never leaks
    # the conversation goes on with the call and its result in it
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    script(model, engine, "It is sunny.")
    r2 = client.chat.completions.create(model="x", messages=follow, tools=WEATHER)
    assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
    assert "18 C, sunny" in engine.tokenizer.decode(model.prompts[-1])


LONG_ARGS = {"city": "Paris", "when": "tomorrow morning", "units": "metric",
             "note": "a long note so that the arguments take many tokens: \"quoted\", braces } { and 日本語"}


def accumulate(chunks) -> tuple[dict[int, dict], dict[int, int]]:
    """The tool calls a streaming client puts together from the deltas (as the openai client's helpers do), and
    how many deltas carried a piece of each call's arguments."""
    calls: dict[int, dict] = {}
    pieces: dict[int, int] = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            if tc.index not in calls:  # the first delta of a call names it
                assert tc.id and tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:  # the others carry only pieces of the arguments
                assert tc.id is None and tc.type is None and tc.function.name is None
            if tc.function.arguments:
                calls[tc.index]["arguments"] += tc.function.arguments
                pieces[tc.index] = pieces.get(tc.index, 0) + 1
    return calls, pieces


@pytest.mark.parametrize("form", ["hermes", "llama3"])
def test_tool_call_arguments_stream_in_pieces(client, srv, model, engine, form):
    args = json.dumps(LONG_ARGS, ensure_ascii=False)
    if form == "hermes":
        text = ('<tool_call>\n{"name": "get_weather", "arguments": ' + args + '}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
        want = [LONG_ARGS, {"city": "Oslo"}]
    else:
        text = '<|python_tag|>{"name": "get_weather", "parameters": ' + args + '}'
        want = [LONG_ARGS]
    script(model, engine, text)
    chunks = list(client.chat.completions.create(model="x", messages=ASK, tools=WEATHER, stream=True))
    calls, pieces = accumulate(chunks)
    assert sorted(calls) == list(range(len(want)))
    assert [json.loads(calls[i]["arguments"]) for i in range(len(want))] == want
    assert all(calls[i]["name"] == "get_weather" for i in calls) and len({c["id"] for c in calls.values()}) == len(want)
    assert pieces[0] > 5, "a long call's arguments come in pieces as they are generated"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    # every piece arrives before the chunk that ends the reply, in a chunk of its own
    last = max(i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls)
    assert last < len(chunks) - 1
    raw = [c for c in sse(srv.url, "/v1/chat/completions", {"messages": ASK, "tools": WEATHER, "stream": True})[:-1]]
    entries = [tc for c in raw if c["choices"] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert entries[0].keys() == {"index", "id", "type", "function"} and entries[0]["function"]["arguments"] == ""
    assert all(e.keys() == {"index", "function"} and e["function"].keys() == {"arguments"} for e in entries[1:]
               if e["index"] == 0)
    r = client.chat.completions.create(model="x", messages=ASK, tools=WEATHER)  # not streamed: unchanged
    assert [json.loads(tc.function.arguments) for tc in r.choices[0].message.tool_calls] == want
    assert r.choices[0].message.tool_calls[0].function.arguments == json.dumps(LONG_ARGS, ensure_ascii=False)


def test_json_reply_naming_no_tool_streams_as_one_call_at_the_end(client, model, engine):
    script(model, engine, '{"name": "not_a_tool", "parameters": {"a": 1}}')
    chunks = list(client.chat.completions.create(model="x", messages=ASK, tools=WEATHER, stream=True))
    calls, pieces = accumulate(chunks)
    assert calls[0]["name"] == "not_a_tool" and json.loads(calls[0]["arguments"]) == {"a": 1} and pieces[0] == 1


def test_llama3_json_tool_call_and_plain_json_without_tools(client, model, engine):
    script(model, engine, '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    r = client.chat.completions.create(model="x", messages=ASK, tools=WEATHER)
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    r = client.chat.completions.create(model="x", messages=ASK)  # no tools asked: JSON is just text
    assert r.choices[0].message.content == '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    r = client.chat.completions.create(model="x", messages=ASK, tools=WEATHER, tool_choice="none")
    assert not r.choices[0].message.tool_calls


def test_reasoning_content(client, model, engine):
    script(model, engine, "<think>The user greets; greet back.</think>\n\nHello there!")
    r = client.chat.completions.create(model="x", messages=ASK)
    msg = r.choices[0].message
    assert msg.content == "Hello there!" and msg.model_extra["reasoning_content"] == "The user greets; greet back."
    chunks = list(client.chat.completions.create(model="x", messages=ASK, stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == "The user greets; greet back." and content == "Hello there!"
    assert not any("think>" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_reasoning_format_none_keeps_the_tags(engine):
    m = ScriptedModel(engine.tokenizer.encode("<think>hmm</think>Hi", add_special=False))
    with server(engine, m, reasoning_format="none") as s:
        status, _, raw = post(s.url, "/v1/chat/completions", {"messages": ASK})
    msg = json.loads(raw)["choices"][0]["message"]
    assert status == 200 and msg["content"] == "<think>hmm</think>Hi" and "reasoning_content" not in msg


@pytest.mark.parametrize("source,words", [
    ("{{ messages | no_such_filter }}", "no_such_filter"),
    ("{{ raise_exception('this template takes no system role') }}", "no system role"),
    ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", "failed to render"),
])
def test_template_failures_are_400(engine, tmp_path, source, words):
    path = tmp_path / "t.jinja"
    path.write_text(source, encoding="utf-8")
    with server(engine, ScriptedModel([1]), chat_template=str(path)) as s:
        status, _, raw = post(s.url, "/v1/chat/completions", {"messages": ASK})
    err = json.loads(raw)["error"]
    assert status == 400 and words in err["message"] and "Traceback" not in err["message"]
