"""The one slot under load: a client that disconnects stops its generation and frees the slot, a queued client
that leaves is never run, the queue is served in arrival order, a slow client holds nobody up, and 50 concurrent
streaming clients (some leaving early) all get their answer with nothing leaked afterwards (checked on /metrics)."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from serve_helpers import ScriptedModel, engine_for, metrics, post, server, sse, wait_for  # noqa: E402

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(smollm2_model):
    return engine_for(str(smollm2_model))


def raw_request(url: str, path: str, body: dict) -> socket.socket:
    """A connected socket that has sent a POST; the caller reads or closes it."""
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_until(sock: socket.socket, needle: bytes, count: int = 1) -> bytes:
    buf = b""
    while buf.count(needle) < count:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def test_disconnect_mid_stream_stops_generation_and_frees_the_slot(engine):
    model = ScriptedModel(engine.tokenizer.encode(" tick" * 400, add_special=False), delay_s=0.01)
    with server(engine, model) as s:
        sock = raw_request(s.url, "/v1/chat/completions", {"messages": ASK, "stream": True})
        got = read_until(sock, b"tick", 3)
        assert b"tick" in got
        sock.close()
        wait_for(lambda: metrics(s.url)["hybrid_requests_cancelled_total"] == 1, what="the cancellation")
        m = metrics(s.url)
        assert m["hybrid_requests_processing"] == 0 and m["hybrid_requests_deferred"] == 0
        stopped_at = model.yielded
        assert stopped_at < 200, f"generation went on for {stopped_at} tokens after the client left"
        time.sleep(0.1)
        assert model.yielded == stopped_at  # nothing runs for the gone client
        model.reply, model.delay_s = engine.tokenizer.encode("next", add_special=False), 0.0
        status, _, raw = post(s.url, "/v1/chat/completions", {"messages": ASK}, timeout=10)
        assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "next"


def test_queued_and_non_streaming_clients_that_leave(engine):
    model = ScriptedModel(engine.tokenizer.encode(" tock" * 60, add_special=False), delay_s=0.01)
    with server(engine, model) as s:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, s.url, "/v1/chat/completions", {"messages": ASK})
            wait_for(lambda: metrics(s.url)["hybrid_requests_processing"] == 1, what="the first request to run")
            queued = raw_request(s.url, "/v1/chat/completions", {"messages": ASK, "stream": True})
            wait_for(lambda: metrics(s.url)["hybrid_requests_deferred"] == 1, what="the second request to queue")
            queued.close()
            wait_for(lambda: metrics(s.url)["hybrid_requests_deferred"] == 0, what="the queue to forget it")
            status, _, raw = first.result(timeout=30)
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == len(model.reply)
        time.sleep(0.3)
        assert model.started == 1  # the client that left while queued never ran
        waiting = raw_request(s.url, "/v1/chat/completions", {"messages": ASK})  # not streamed, then gone
        wait_for(lambda: metrics(s.url)["hybrid_requests_processing"] == 1, what="the third request to run")
        waiting.close()
        wait_for(lambda: metrics(s.url)["hybrid_requests_cancelled_total"] == 1, what="the non-streaming cancel")
        assert metrics(s.url)["hybrid_requests_processing"] == 0


def _arrived(m: dict) -> int:
    """Requests the server has seen, each counted once from one reading of /metrics: queued, running or done."""
    return m["hybrid_requests_deferred"] + m["hybrid_requests_processing"] + m["hybrid_requests_total"]


def test_requests_are_served_in_arrival_order(engine):
    model = ScriptedModel(engine.tokenizer.encode(" ok" * 20, add_special=False), delay_s=0.005)
    with server(engine, model) as s:
        with ThreadPoolExecutor(5) as pool:
            futures = []
            for i in range(5):
                body = {"messages": [{"role": "user", "content": f"client number {i}"}], "cache_prompt": False}
                futures.append(pool.submit(post, s.url, "/v1/chat/completions", body))
                wait_for(lambda i=i: _arrived(metrics(s.url)) >= i + 1, what=f"request {i} to arrive")
            assert all(f.result(timeout=60)[0] == 200 for f in futures)
    order = [next(i for i in range(5) if f"client number {i}" in engine.tokenizer.decode(p)) for p in model.prompts]
    assert order == [0, 1, 2, 3, 4]


def test_a_slow_client_holds_nobody_up(engine):
    model = ScriptedModel(engine.tokenizer.encode("done", add_special=False))
    with server(engine, model) as s:
        u = urlparse(s.url)
        body = json.dumps({"messages": ASK}).encode()
        slow = socket.create_connection((u.hostname, u.port), timeout=30)
        slow.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        t0 = time.monotonic()
        status, _, _ = post(s.url, "/v1/chat/completions", {"messages": ASK}, timeout=10)
        assert status == 200 and time.monotonic() - t0 < 5
        for i in range(5, len(body), 7):  # the rest, a few bytes at a time
            slow.sendall(body[i: i + 7])
            time.sleep(0.02)
        reply = read_until(slow, b"}}", 1)
        slow.close()
        assert reply.startswith(b"HTTP/1.1 200") and b'"done"' in reply


def test_fifty_concurrent_streams_some_leaving(smollm2_model):
    engine = engine_for(str(smollm2_model))
    with server(engine, cache_ram=64 << 20) as s:
        before = metrics(s.url)

        def client(i: int):
            body = {"messages": [{"role": "user", "content": f"Say a word, {i}."}], "max_tokens": 2,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            if i % 5 == 4:  # one in five leaves after the first bytes
                sock = raw_request(s.url, "/v1/chat/completions", body)
                sock.recv(10)
                sock.close()
                return None
            return sse(s.url, "/v1/chat/completions", body, timeout=120)

        with ThreadPoolExecutor(50) as pool:
            results = list(pool.map(client, range(50)))
        answered = [r for r in results if r is not None]
        assert len(answered) == 40
        for events in answered:
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] >= 1
            assert events[-3]["choices"][0]["finish_reason"] in ("stop", "length")
        wait_for(lambda: metrics(s.url)["hybrid_requests_processing"] == 0, what="the slot to be free")
        after = metrics(s.url)
        assert after["hybrid_requests_deferred"] == 0
        done = after["hybrid_requests_total"] - before["hybrid_requests_total"]
        assert 40 <= done <= 50  # a client that left while queued is never run
        assert after["hybrid_prompt_cache_ram_bytes"] <= 64 << 20
        status, _, raw = post(s.url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2})
        assert status == 200
