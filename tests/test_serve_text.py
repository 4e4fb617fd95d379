"""hybrid serve's pieces without a server: stop strings held back, <think> split off, tool calls caught and
parsed, request checks, the prompt cache's prefix reuse and RAM bound, the metrics text."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from hybrid.kv.cache import KVCache
from hybrid.server.holdback import StopStrings, partial_tail
from hybrid.server.metrics import Metrics, parse, render
from hybrid.server.prompt_cache import MIN_SAVE_TOKENS, PromptCache, common_prefix
from hybrid.server.reasoning import ReasoningSplitter
from hybrid.server.schemas import BadRequest, parse_chat, parse_completion
from hybrid.server.toolcall_stream import ToolCallCatcher
from hybrid.server.toolcalls import parse_tool_calls


def feed(filter_push, pieces):
    return [filter_push(p) for p in pieces]


def test_partial_tail():
    assert partial_tail("hello wor", ("world",)) == 3
    assert partial_tail("hello", ("world",)) == 0
    assert partial_tail("ab<", ("<think>", "</think>")) == 1
    assert partial_tail("x</th", ("</think>",)) == 4
    assert partial_tail("", ("abc",)) == 0


@pytest.mark.parametrize("pieces", [["Hello ", "wor", "ld", " again"], ["Hello w", "o", "r", "ld"], ["Hello world"]])
def test_stop_string_split_across_pieces_never_leaks(pieces):
    s = StopStrings(["world"])
    out = "".join(feed(s.push, pieces))
    assert s.stopped and out == "Hello "


def test_stop_holdback_released_when_not_a_stop():
    s = StopStrings(["###"])
    assert s.push("a #") == "a "  # '#' may start the stop string: held
    assert s.push("#") == ""  # '##' still may
    assert s.push(" b") == "## b"
    assert s.flush() == "" and not s.stopped
    s = StopStrings(["END"])
    assert s.push("xE") == "x" and s.flush() == "E"


def test_earliest_of_several_stops_wins():
    s = StopStrings(["b", "a"])
    assert s.push("xyab") == "xy" and s.stopped


def split(pieces, started=False):
    r = ReasoningSplitter(True, started)
    parts = [p for piece in pieces for p in r.push(piece)] + r.flush()
    return "".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content")


@pytest.mark.parametrize("pieces", [["<think>I ponder</think>\n\nAnswer"], ["<th", "ink>I pon", "der</th", "ink>", "\n", "Answer"],
                                    ["\n<think>", "I ponder", "</think>Answer"]])
def test_reasoning_split_at_any_piece_boundary(pieces):
    assert split(pieces) == ("I ponder", "Answer")


def test_reasoning_only_at_the_start_and_none_format():
    assert split(["Sure. <think>not reasoning</think>"]) == ("", "Sure. <think>not reasoning</think>")
    assert split(["I ponder</think>Answer"], started=True) == ("I ponder", "Answer")
    assert split(["<think>cut off"]) == ("cut off", "")
    r = ReasoningSplitter(False)
    assert r.push("<think>x</think>y") == [("content", "<think>x</think>y")]


def catch(pieces, enabled=True):
    c = ToolCallCatcher(enabled)
    shown = "".join(c.push(p) for p in pieces)
    rest, calls = c.finish()
    return shown, rest, calls


def test_hermes_tool_call_caught_across_pieces():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    shown, rest, calls = catch(["Let me check. <tool", "_call>", call[len("<tool_call>"):]])
    assert shown == "Let me check. " and rest == ""
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_several_hermes_calls_and_a_missing_close_tag():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}')
    calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": 1}


def test_llama3_json_tool_call():
    for text in ('{"name": "search", "parameters": {"q": "hi"}}', '<|python_tag|>{"name": "search", "parameters": {"q": "hi"}}'):
        shown, rest, calls = catch([text[:5], text[5:]])
        assert shown == "" and rest == ""
        assert calls[0]["function"]["name"] == "search" and json.loads(calls[0]["function"]["arguments"]) == {"q": "hi"}


def test_text_that_is_no_tool_call_comes_back_as_content():
    shown, rest, calls = catch(['{"not": "a call"}'])
    assert calls == [] and shown + rest == '{"not": "a call"}'
    shown, rest, calls = catch(["<tool_call>{broken json</tool_call>"])
    assert calls == [] and shown + rest == "<tool_call>{broken json</tool_call>"
    shown, rest, calls = catch(["plain text with { braces }"])
    assert calls == [] and shown == "plain text with { braces }" and rest == ""
    shown, rest, calls = catch(["<tool_call>x"], enabled=False)
    assert shown == "<tool_call>x" and calls == []


def stream_calls(text, names=frozenset({"f"}), step=3):
    """A reply fed to the catcher `step` characters at a time: (the delta entries in order, the parsed calls)."""
    c = ToolCallCatcher(True, names)
    entries = []
    for i in range(0, len(text), step):
        assert c.push(text[i:i + step]) == ""
        entries += c.deltas()
    rest, calls = c.finish()
    return entries + c.deltas(), calls, rest


@pytest.mark.parametrize("text,args", [
    ('<tool_call>{"arguments": {"x": [1, {"y": "}"}]}, "name": "f"}</tool_call>', {"x": [1, {"y": "}"}]}),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', {"x": 1}),  # arguments as a string
    ('{"name": "f"}', {}),
    ('<|python_tag|>[{"name": "f", "parameters": {"x": 2}}]', {"x": 2}),
])
def test_streamed_arguments_add_up_to_the_call(text, args):
    entries, calls, rest = stream_calls(text)
    assert rest == "" and entries[0]["id"] == calls[0]["id"] and entries[0]["function"]["name"] == "f"
    assert json.loads("".join(e["function"].get("arguments", "") for e in entries)) == args
    assert all("id" not in e for e in entries[1:])


def test_a_malformed_call_after_its_start_comes_back_as_content():
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}} trailing</tool_call>'
    entries, calls, rest = stream_calls(text)
    assert calls == [] and rest == text and entries[0]["function"]["name"] == "f"


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,field,words", [
    ([1, 2], None, "JSON object"),
    ({**CHAT, "temperature": "hot"}, "temperature", "must be a number, got string"),
    ({**CHAT, "max_tokens": 0}, "max_tokens", "at least 1, got 0"),
    ({**CHAT, "max_tokens": -5}, "max_tokens", "at least 1, got -5"),
    ({**CHAT, "max_tokens": 2.5}, "max_tokens", "integer"),
    ({**CHAT, "n": 2}, "n", "must be 1"),
    ({**CHAT, "top_p": 0}, "top_p", "above 0"),
    ({**CHAT, "stop": 5}, "stop", "string or an array"),
    ({**CHAT, "stream": "yes"}, "stream", "boolean"),
    ({**CHAT, "top_logprobs": 3}, "top_logprobs", "needs 'logprobs'"),
    ({"messages": []}, "messages", "empty"),
    ({"messages": "hi"}, "messages", "array"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content", "image_url"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format", "not supported"),
])
def test_chat_request_errors_name_the_field(body, field, words):
    with pytest.raises(BadRequest) as e:
        parse_chat(body)
    assert e.value.param == field and words in e.value.message and e.value.status == 400


def test_chat_request_values_and_unknown_fields():
    req = parse_chat({**CHAT, "max_completion_tokens": 7, "temperature": 0, "seed": 3, "stop": "x", "whatever": {"a": 1},
                      "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.max_tokens == 7 and req.sampling.temp == 0 and req.sampling.seed == 3 and req.stop == ["x"]
    assert req.stream and req.include_usage and req.logprobs and req.top_logprobs == 2
    assert req.messages[0]["content"] == "a\nb"
    assert parse_chat(CHAT).max_tokens == -1


def test_completion_request_forms():
    assert parse_completion({"prompt": "hi"}).prompt == "hi"
    assert parse_completion({"prompt": ["hi"]}).prompt == "hi"
    assert parse_completion({"prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert parse_completion({"prompt": "x", "logprobs": 2}).top_logprobs == 2
    for bad, words in (({"prompt": ""}, "empty"), ({"prompt": ["a", "b"]}, "one per request"), ({}, "got null"),
                       ({"prompt": "x", "echo": True}, "echo")):
        with pytest.raises(BadRequest, match=words):
            parse_completion(bad)


@dataclass
class FakeLayer:
    k: np.ndarray
    v: np.ndarray

    @property
    def nbytes(self):
        return self.k.nbytes + self.v.nbytes


def fake_cache(n_ctx=512, n_layer=2):
    return KVCache(n_ctx, "f16", "f16", [FakeLayer(np.zeros((n_ctx, 1, 4), np.uint8), np.zeros((n_ctx, 1, 4), np.uint8))
                                         for _ in range(n_layer)])


def fill(pc: PromptCache, ids: list[int]) -> None:
    """As a generation would: write a row per token (its id) from n_past on, then record the ids."""
    for p in range(pc.cache.n_past, len(ids)):
        for layer in pc.cache.layers:
            layer.k[p] = ids[p] % 251
            layer.v[p] = (ids[p] * 7) % 251
    pc.cache.n_past = len(ids)
    pc.finish(ids)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0


def test_prompt_cache_reuses_the_longest_prefix_and_keeps_one_token_to_evaluate():
    pc = PromptCache(fake_cache(), ram_bytes=0)
    a = list(range(100))
    assert pc.prepare(a) == 0
    fill(pc, a)
    assert pc.prepare(a + [500, 501]) == 100
    assert pc.prepare(a) == 99  # the whole prompt is cached: the last token is evaluated again for its logits
    assert pc.prepare(a[:50] + [7, 8]) == 50 and pc.cache.n_past == 50
    assert pc.prepare(a, reuse=False) == 0


def test_prompt_cache_restores_a_saved_conversation_from_ram():
    pc = PromptCache(fake_cache(), ram_bytes=1 << 20)
    a = list(range(1, MIN_SAVE_TOKENS + 40))
    b = [9000 + i for i in range(MIN_SAVE_TOKENS + 10)]
    pc.prepare(a)
    fill(pc, a)
    rows_a = [layer.k[: len(a)].copy() for layer in pc.cache.layers]
    assert pc.prepare(b) == 0 and len(pc.saved) == 1  # a was saved before b overwrote it
    fill(pc, b)
    assert pc.prepare(a + [1, 2]) == len(a)  # restored from RAM
    assert all(np.array_equal(layer.k[: len(a)], r) for layer, r in zip(pc.cache.layers, rows_a))
    assert pc.saved_bytes > 0


def test_prompt_cache_ram_bound_drops_the_oldest():
    n = MIN_SAVE_TOKENS + 6
    one_state = 2 * 2 * n * 4  # 2 layers x (k + v) x n rows x 4 bytes
    pc = PromptCache(fake_cache(), ram_bytes=2 * one_state)
    convs = [[1000 * c + i for i in range(n)] for c in range(4)]
    for ids in convs:
        pc.prepare(ids)
        fill(pc, ids)
    pc.prepare([7] * 10)
    assert pc.saved_bytes <= 2 * one_state and len(pc.saved) == 2
    assert set(pc.saved) == {tuple(convs[2]), tuple(convs[3])}
    assert PromptCache(fake_cache(), ram_bytes=0).saved_bytes == 0


def test_metrics_text_is_prometheus():
    m = Metrics()
    m.add(prompt_tokens=10, prompt_seconds=0.5, predicted_tokens=4, predicted_seconds=0.2, requests=1)
    text = render(m, {"requests_processing": (0, "running")})
    got = parse(text)
    assert got["hybrid_prompt_tokens_total"] == 10 and got["hybrid_prompt_tokens_seconds"] == 20.0
    assert got["hybrid_predicted_tokens_seconds"] == 20.0 and got["hybrid_requests_processing"] == 0
    assert "# TYPE hybrid_requests_total counter" in text


def test_prompt_cache_of_a_paged_cache_saves_and_restores_through_the_table(tmp_path):
    """The -np 1 server's live cache is Engine.new_cache's paged sequence: a conversation saved to RAM and restored
    into other blocks (its table no longer 0, 1, 2, ...) continues with the logits of a cache that evaluated it."""
    from hybrid.engine import Engine, EngineParams  # noqa: PLC0415
    from hybrid.tools.synth.model import ModelShape, make_model  # noqa: PLC0415

    path = tmp_path / "llama.gguf"
    make_model(path, "llama", ModelShape(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=512),
               "Q4_K_M", seed=5, threads=2)
    engine = Engine.load(path, EngineParams(n_ctx=256))
    try:
        pc = PromptCache(engine.new_cache(), ram_bytes=1 << 24)
        assert pc.cache.paged
        rng = np.random.default_rng(4)
        a = [int(t) for t in rng.integers(3, 512, MIN_SAVE_TOKENS + 30)]
        b = [int(t) for t in rng.integers(3, 512, MIN_SAVE_TOKENS + 5)]
        assert pc.prepare(a) == 0
        engine.eval(a, pc.cache)
        pc.finish(a)
        assert pc.prepare(b) == 0 and len(pc.saved) == 1  # a saved before b overwrites it
        pc.cache.release()  # b's rows go to other blocks: the table is no longer the identity
        engine.eval(b, pc.cache)
        pc.finish(b)
        assert list(pc.cache.table[:2]) != [0, 1]
        assert pc.prepare(a + [7]) == len(a)  # restored from RAM through the table
        got = engine.eval([7], pc.cache)
        want = engine.eval(a + [7], engine.new_cache())
        np.testing.assert_array_equal(got, want)
    finally:
        engine.close()
