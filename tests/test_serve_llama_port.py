"""Checks ported from llama.cpp's server tests (tools/server/tests/unit/test_chat_completion.py and
test_completion.py) that apply to one slot and to our models: SmolLM2-135M-Instruct where the model's output
matters, the scripted model where only the server's bookkeeping does. Our own code; the llama.cpp test each one
follows is named in its docstring. llama.cpp's native `/completion` route (content, n_probs, stop_type, …) is not
ours: its checks run against `/v1/completions` with the OpenAI names (text, logprobs: N, finish_reason).

Not ported, and why:
- several slots or requests batched in one (n_slots > 1, kv_unified, id_slot, `n` > 1 choices, a `prompt` holding
  several prompts): one generation slot until continuous batching lands; those are 400s here (tested in
  test_serve_errors.py / test_serve_text.py);
- grammars, json_schema, response_format json_object/json_schema: no constrained sampling yet (refused with 400);
- multimodal prompts (`multimodal_data`, the `{"prompt_string": …}` form), speculative decoding, LoRA, backend
  sampling: not in hybrid;
- logit_bias, post_sampling_probs, return_progress (prompt_progress), timings_per_token, response_fields,
  return_tokens, `__verbose`/`verbose`, /chat/completions/input_tokens, continue_final_message /
  add_generation_prompt in the body: llama-server extras issue 19 does not ask for (unknown fields are ignored);
- n_batch changes, a `--chat-template` that is a literal jinja string, the codellama70b and command-r templates
  (other models' templates), `system_fingerprint` starting with "b" (llama.cpp's build number; ours is "hybrid");
- the exact texts and token counts of tinyllama2: other model; the same checks are made against our numbers.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
from urllib.parse import urlparse

import pytest

openai = pytest.importorskip("openai", reason="the openai client is a test extra: pip install -e '.[test]'")

from serve_helpers import ScriptedModel, engine_for, metrics, post, server, sse, wait_for  # noqa: E402

BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
LIFE = "I believe the meaning of life is"
TIMINGS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
           "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture(scope="module")
def engine(smollm2_model):
    return engine_for(str(smollm2_model))


@pytest.fixture(scope="module")
def srv(engine):
    with server(engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="dummy", max_retries=0, timeout=120)


def n_tokens(srv, text: str, add_special: bool = True) -> int:
    status, _, raw = post(srv.url, "/tokenize", {"content": text, "add_special": add_special})
    assert status == 200, raw
    return len(json.loads(raw)["tokens"])


# ---- test_chat_completion.py

def test_chat_completion(srv):
    """test_chat_completion: the basic fields, usage and finish_reason of a length-limited reply."""
    status, _, raw = post(srv.url, "/chat/completions", {"max_tokens": 8, "messages": BOOK, "temperature": 0})
    assert status == 200, raw
    body = json.loads(raw)
    assert "cmpl" in body["id"] and body["object"] == "chat.completion" and body["model"] == "test-model"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["message"]["content"] and choice["finish_reason"] == "length"
    usage, t = body["usage"], body["timings"]
    assert usage["completion_tokens"] == 8 == t["predicted_n"]
    assert usage["prompt_tokens"] == t["prompt_n"] + t["cache_n"]
    assert t["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert set(t) == TIMINGS and all(v >= 0 for v in t.values())
    status, _, raw = post(srv.url, "/apply-template", {"messages": BOOK})
    assert usage["prompt_tokens"] == n_tokens(srv, json.loads(raw)["prompt"])  # what the template rendered


def test_chat_completion_content_parts(srv):
    """test_chat_completion with content as text parts: joined with a newline, as llama-server does."""
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]
    status, _, raw = post(srv.url, "/apply-template", {"messages": [{"role": "user", "content": parts}]})
    assert status == 200 and "What is\nthe best book" in json.loads(raw)["prompt"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_completion_stream(srv, include_usage):
    """test_chat_completion_stream (+ test_chat_completion_with_timings_per_token's shape): role first, the same
    id throughout, no content beside finish_reason, usage and timings at the end."""
    events = sse(srv.url, "/chat/completions", {"max_tokens": 8, "messages": BOOK, "stream": True, "temperature": 0,
                                                "stream_options": {"include_usage": include_usage}})
    assert events[-1] == "[DONE]"
    chunks, content = events[:-1], ""
    assert "timings" not in chunks[0]
    for i, data in enumerate(chunks):
        assert data["id"] == chunks[0]["id"] and data["model"] == "test-model"
        if not data["choices"]:
            assert include_usage and data is chunks[-1]
            assert data["usage"]["completion_tokens"] == 8 and data["usage"]["prompt_tokens"] > 0
            assert {"prompt_per_second", "predicted_per_second", "predicted_n"} <= set(data["timings"])
            continue
        choice = data["choices"][0]
        if i == 0:
            assert choice["delta"]["role"] == "assistant" and not choice["delta"].get("content")
        else:
            assert "role" not in choice["delta"]
        if choice["finish_reason"] is not None:
            assert choice["finish_reason"] == "length" and "content" not in choice["delta"]
            assert data["timings"]["predicted_n"] == 8
        else:
            content += choice["delta"].get("content") or ""
    assert content


def test_chat_completion_with_openai_library(client):
    """test_chat_completion_with_openai_library: seed and temperature through the client."""
    r = client.chat.completions.create(model="gpt-3.5-turbo-instruct", messages=BOOK, max_tokens=8, seed=42,
                                       temperature=0.8)
    assert r.system_fingerprint is not None and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content is not None


def test_chat_completion_cached_tokens(engine):
    """test_chat_completion_cached_tokens: one slot; the same prompt again reuses all but its last token, a changed
    one the common prefix."""
    model = ScriptedModel(engine.tokenizer.encode(" one two three", add_special=False))
    seq = ["1 2 3 4 5 6", "1 2 3 4 5 6", "1 2 3 4 5 9", "1 2 3 9 9 9"]
    with server(engine, model) as s:
        full = []
        for text in seq:  # each conversation's token ids, as the template renders them
            _, _, raw = post(s.url, "/apply-template", {"messages": [{"role": "system", "content": "Test"},
                                                                     {"role": "user", "content": text}]})
            _, _, raw = post(s.url, "/tokenize", {"content": json.loads(raw)["prompt"], "add_special": True})
            full.append(json.loads(raw)["tokens"])
        held: list[int] = []
        cached = []
        for ids, text in zip(full, seq):
            status, _, raw = post(s.url, "/chat/completions", {"max_tokens": 8, "messages": [
                {"role": "system", "content": "Test"}, {"role": "user", "content": text}]})
            usage = json.loads(raw)["usage"]
            same = next((k for k, (a, b) in enumerate(zip(ids, held)) if a != b), min(len(ids), len(held)))
            assert usage["prompt_tokens"] == len(ids)
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            assert cached[-1] == min(same, len(ids) - 1)
            held = ids + model.reply
    assert cached[0] == 0 and cached[1] == len(full[1]) - 1 and cached[1] > cached[2] > cached[3] > 0


@pytest.mark.parametrize("prefill", ["Whill", [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]])
def test_chat_template_assistant_prefill(srv, prefill):
    """test_chat_template_assistant_prefill: a last assistant message is continued, not closed."""
    status, _, raw = post(srv.url, "/apply-template", {"messages": BOOK + [{"role": "assistant", "content": prefill}]})
    assert status == 200
    prompt = json.loads(raw)["prompt"]
    _, _, plain = post(srv.url, "/apply-template", {"messages": BOOK})
    want = "Whill" if isinstance(prefill, str) else "Wh\nill"
    assert prompt == json.loads(plain)["prompt"] + want  # the generation prompt, then the text to continue


def test_apply_chat_template(srv):
    """test_apply_chat_template (with SmolLM2's own template): /apply-template gives the rendered prompt."""
    status, _, raw = post(srv.url, "/apply-template", {"messages": [{"role": "system", "content": "You are a test."},
                                                                   {"role": "user", "content": "Hi there"}]})
    assert status == 200
    assert json.loads(raw)["prompt"] == ("<|im_start|>system\nYou are a test.<|im_end|>\n<|im_start|>user\n"
                                         "Hi there<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("response_format", [{"type": "sound"}, {"type": "json_object"},
                                             {"type": "json_schema", "json_schema": {"schema": {"const": "42"}}}])
def test_completion_with_response_format_refused(srv, response_format):
    """test_completion_with_response_format: an unknown type is a 400 (and so, here, are the constrained ones)."""
    status, _, raw = post(srv.url, "/chat/completions", {"max_tokens": 4, "messages": BOOK,
                                                         "response_format": response_format})
    assert status == 400 and "error" in json.loads(raw)


@pytest.mark.parametrize("messages", [
    None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
    [{"role": "system", "content": "test"}, {}],
    [{"role": "user", "content": "test"}, {"role": "assistant", "content": "test"},
     {"role": "assistant", "content": "test"}],
])
def test_invalid_chat_completion_req(srv, messages):
    """test_invalid_chat_completion_req: each is a 400 with an error object."""
    status, _, raw = post(srv.url, "/chat/completions", {"messages": messages})
    assert status == 400 and "error" in json.loads(raw)


def test_logprobs(client):
    """test_logprobs: the tokens' texts add up to the content, every logprob <= 0, bytes and top_logprobs there."""
    r = client.chat.completions.create(model="x", temperature=0.0, messages=BOOK, max_tokens=5, logprobs=True,
                                       top_logprobs=10)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(t.logprob <= 0.0 and t.bytes is not None and len(t.top_logprobs) == 10 for t in content)


def test_logprobs_stream(client):
    """test_logprobs_stream: every content chunk carries the logprobs of its tokens."""
    output, aggregated = "", ""
    for i, data in enumerate(client.chat.completions.create(model="x", temperature=0.0, messages=BOOK, max_tokens=5,
                                                            logprobs=True, top_logprobs=10, stream=True)):
        choice = data.choices[0]
        if i == 0:
            assert choice.delta.role == "assistant" and not choice.delta.content
            continue
        assert choice.delta.role is None
        if choice.finish_reason is None:
            output += choice.delta.content or ""
            assert choice.logprobs is not None and choice.logprobs.content is not None
            for t in choice.logprobs.content:
                aggregated += t.token
                assert t.logprob <= 0.0 and t.bytes is not None and len(t.top_logprobs) == 10
    assert output and aggregated == output


@pytest.mark.parametrize("stream", [False, True])
def test_context_size_exceeded(srv, stream):
    """test_context_size_exceeded(_stream): a 400 of type exceed_context_size_error with the numbers, before any
    stream starts."""
    status, hdrs, raw = post(srv.url, "/chat/completions", {"messages": BOOK * 200, "stream": stream})
    err = json.loads(raw)["error"]
    assert status == 400 and hdrs["content-type"].startswith("application/json")
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 2048 and err["n_prompt_tokens"] > 2048


# ---- test_completion.py (against /v1/completions)

def test_completion(srv):
    """test_completion: timings count the prompt's tokens and the predicted ones."""
    status, _, raw = post(srv.url, "/v1/completions", {"n_predict": 8, "prompt": LIFE, "temperature": 0})
    body = json.loads(raw)
    assert status == 200 and body["object"] == "text_completion" and body["choices"][0]["text"]
    t = body["timings"]
    assert t["prompt_n"] + t["cache_n"] == n_tokens(srv, LIFE) == body["usage"]["prompt_tokens"]
    assert t["predicted_n"] == 8 and body["choices"][0]["finish_reason"] == "length"


def test_completion_stream_vs_non_stream(srv):
    """test_completion_stream + test_completion_stream_vs_non_stream: text chunks, then a last chunk with the
    finish_reason and timings; with the same seed the streamed text is the non-streamed one."""
    body = {"max_tokens": 8, "prompt": LIFE, "seed": 42, "temperature": 0.8}
    chunks = sse(srv.url, "/v1/completions", {**body, "stream": True})[:-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["text"] == ""
    assert last["timings"]["predicted_n"] == 8 and set(last["timings"]) == TIMINGS
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    status, _, raw = post(srv.url, "/v1/completions", body)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == streamed


def test_completion_with_openai_library(client):
    """test_completion_with_openai_library and test_completion_stream_with_openai_library. Greedy: llama.cpp's
    test samples at the server's default temperature with a random seed, which on SmolLM2 can end the reply with
    EOS before the 8th token (finish_reason "stop")."""
    r = client.completions.create(model="davinci-002", prompt=LIFE, max_tokens=8, temperature=0)
    assert r.system_fingerprint is not None and r.choices[0].finish_reason == "length" and r.choices[0].text
    text = ""
    for data in client.completions.create(model="davinci-002", prompt=LIFE, max_tokens=8, stream=True,
                                          temperature=0):
        if data.choices[0].finish_reason is None:
            assert data.choices[0].text is not None
            text += data.choices[0].text
    assert text


def test_consistent_result_same_seed(client):
    """test_consistent_result_same_seed (one slot)."""
    kw = dict(model="x", prompt=LIFE, max_tokens=12, seed=42, temperature=0.0, extra_body={"cache_prompt": False})
    texts = {client.completions.create(**kw).choices[0].text for _ in range(3)}
    assert len(texts) == 1


def test_different_result_different_seed(client):
    """test_different_result_different_seed (one slot): at temperature 1 each seed gives its own text, and
    each seed its own text again."""
    def text(seed):
        return client.completions.create(model="x", prompt=LIFE, max_tokens=12, seed=seed, temperature=1.0,
                                         extra_body={"cache_prompt": False}).choices[0].text

    texts = [text(seed) for seed in range(3)]
    assert texts[0] != texts[1] != texts[2]
    assert text(1) == texts[1]


def test_nocache_long_input_prompt(srv):
    """test_nocache_long_input_prompt: a prompt longer than the context is a 400."""
    status, _, raw = post(srv.url, "/v1/completions", {"prompt": LIFE * 400, "seed": 42, "temperature": 1.0,
                                                       "cache_prompt": False})
    assert status == 400 and json.loads(raw)["error"]["type"] == "exceed_context_size_error"


def test_completion_with_tokens_input(srv):
    """test_completion_with_tokens_input: token ids from /tokenize; token ids and text mixed in one prompt."""
    _, _, raw = post(srv.url, "/tokenize", {"content": LIFE, "add_special": True})
    tokens = json.loads(raw)["tokens"]
    outs = []
    for prompt in (LIFE, tokens, [tokens], [LIFE, 7, 8], [7, LIFE]):
        status, _, raw = post(srv.url, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
        body = json.loads(raw)
        assert status == 200, raw
        outs.append((body["usage"]["prompt_tokens"], body["choices"][0]["text"]))
    assert outs[0] == outs[1] == outs[2]  # text, ids, a batch of one: the same prompt
    assert outs[3][0] == len(tokens) + 2  # a string first is tokenized with the special tokens
    assert outs[4][0] == 1 + n_tokens(srv, LIFE, add_special=False)  # elsewhere without
    status, _, raw = post(srv.url, "/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, LIFE, 7, 8, 9, 10, LIFE],
                                                       "max_tokens": 2})
    assert status == 200 and isinstance(json.loads(raw)["choices"][0]["text"], str)


def test_completion_parallel_requests_one_slot(srv):
    """test_completion_parallel_slots with one slot and three requests: all answered."""
    prompts = ["Write a very long book.", "Write another a poem.", "What is LLM?"]
    results: list = [None] * len(prompts)

    def ask(i):
        results[i] = post(srv.url, "/v1/completions", {"prompt": prompts[i], "seed": 42, "temperature": 1.0,
                                                       "max_tokens": 12})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for status, _, raw in results:
        assert status == 200 and len(json.loads(raw)["choices"][0]["text"]) > 10


def test_n_probs(client):
    """test_n_probs: logprobs: 10 gives five tokens each with ten alternatives, every logprob <= 0."""
    r = client.completions.create(model="x", prompt=LIFE, logprobs=10, temperature=0.0, max_tokens=5)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0.0 for v in lp.token_logprobs) and all(len(d) == 10 for d in lp.top_logprobs)
    assert all(v <= 0.0 for d in lp.top_logprobs for v in d.values())
    assert "".join(lp.tokens) == r.choices[0].text


def test_n_probs_stream(client):
    """test_n_probs_stream: every chunk but the last carries the logprobs of its tokens."""
    n = 0
    for data in client.completions.create(model="x", prompt=LIFE, logprobs=10, temperature=0.0, max_tokens=5,
                                          stream=True):
        if data.choices[0].finish_reason is None:
            lp = data.choices[0].logprobs
            assert lp is not None and len(lp.tokens) >= 1 and all(len(d) == 10 for d in lp.top_logprobs)
            assert all(v <= 0.0 for v in lp.token_logprobs)
            n += len(lp.tokens)
    assert n == 5


def test_cancel_request(srv):
    """test_cancel_request: a client that gives up (a 0.1 s timeout) frees the slot."""
    u = urlparse(srv.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=0.1)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": LIFE, "max_tokens": 1000}),
                     headers={"Content-Type": "application/json"})
        with pytest.raises(TimeoutError):
            conn.getresponse()
    finally:
        conn.close()
    wait_for(lambda: metrics(srv.url)["hybrid_requests_processing"] == 0, 10, "the slot to be free")
    status, _, _ = post(srv.url, "/v1/completions", {"prompt": LIFE, "max_tokens": 2})
    assert status == 200


def test_completion_prompt_cache(engine):
    """test_completion_prompt_cache (one slot): alternating prompts going in and out of the cache (host RAM
    states included); prompt_n + cache_n is always the prompt, predicted_n what was asked."""
    rng = random.Random(0)
    model = ScriptedModel(engine.tokenizer.encode(" a b c d e f g h", add_special=False))
    with server(engine, model) as s:
        for _ in range(10):
            r = rng.randint(0, 4)
            prompt, n_predict = (" Hello " + str(r)) * (40 + r), rng.randint(1, 8)
            status, _, raw = post(s.url, "/v1/completions", {"prompt": prompt, "n_predict": n_predict})
            body = json.loads(raw)
            assert status == 200 and isinstance(body["choices"][0]["text"], str)
            t = body["timings"]
            assert t["prompt_n"] + t["cache_n"] == n_tokens(s, prompt) and t["predicted_n"] == n_predict
        assert metrics(s.url)["hybrid_prompt_cache_hits_total"] > 0
