"""Helpers of the tests/test_serve_*.py files: one engine per model path for the whole session, servers on
127.0.0.1 at a free port (stopped by their context manager), a scripted model, and raw SSE reading."""

from __future__ import annotations

import functools
import http.client
import json
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytest.importorskip("uvicorn", reason="hybrid serve's tests need uvicorn (a dependency; the GPU machine lacks it)")

from hybrid.engine.engine import Engine  # noqa: E402
from hybrid.engine.launch import launch  # noqa: E402
from hybrid.engine.params import EngineParams  # noqa: E402
from hybrid.generate.timings import Timings  # noqa: E402
from hybrid.model.files import default_cache_dir  # noqa: E402
from hybrid.server.running import BackgroundServer  # noqa: E402
from hybrid.server.state import ServerConfig, ServerState  # noqa: E402


@functools.lru_cache(maxsize=None)
def engine_for(path: str, n_ctx: int = 2048) -> Engine:
    engine, _ = launch(Path(path), EngineParams(n_ctx=n_ctx), default_cache_dir(), lambda msg: None)
    engine.warmup()
    return engine


def server(engine: Engine, generate=None, **config) -> BackgroundServer:
    """A server over `engine` on 127.0.0.1 at a free port; use as a context manager."""
    state = ServerState(ServerConfig(**{"alias": "test-model", **config}))
    if generate is not None:
        state.generate = generate
    state.attach(engine)
    return BackgroundServer(state, "127.0.0.1", 0)


class ScriptedModel:
    """A stand-in for hybrid.generate.loop.generate that replies with `reply` (token ids) whatever the prompt,
    `delay_s` apart, keeping the KV cache's position as a real generation would. `started` counts generations."""

    def __init__(self, reply: list[int] | None = None, delay_s: float = 0.0):
        self.reply = reply or []
        self.delay_s = delay_s
        self.started = 0
        self.yielded = 0
        self.prompts: list[list[int]] = []

    def __call__(self, engine, prompt, sampling, n_predict, cache, timings=None):
        timings = timings if timings is not None else Timings()
        self.started += 1
        self.prompts.append(list(prompt))
        cache.reserve(cache.n_past + len(prompt) + max(n_predict, len(self.reply)))  # a paged cache's blocks, as
        cache.n_past += len(prompt)  # Engine.eval takes them
        timings.prompt_tokens += len(prompt)
        for i, t in enumerate(self.reply):
            if 0 <= n_predict <= i:
                return
            if self.delay_s:
                time.sleep(self.delay_s)
            self.yielded += 1
            yield t
            cache.n_past += 1
            timings.eval_tokens += 1


def post(url: str, path: str, body, headers: dict | None = None, timeout: float = 60.0):
    """(status, headers, raw body bytes) of a POST with a JSON (or raw bytes) body."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    conn.close()
    return out


def get(url: str, path: str, headers: dict | None = None, timeout: float = 30.0):
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request("GET", path, headers=headers or {})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read()
    conn.close()
    return out


def sse(url: str, path: str, body: dict, headers: dict | None = None, timeout: float = 60.0) -> list:
    """The data: payloads of a streamed answer in order (parsed JSON, or the string "[DONE]")."""
    status, hdrs, raw = post(url, path, body, headers, timeout)
    assert status == 200, raw
    assert hdrs.get("content-type", "").startswith("text/event-stream")
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert not block.strip(), f"not an SSE data frame: {block!r}"
    return out


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    from hybrid.server.metrics import parse

    status, _, raw = get(url, "/metrics", headers)
    assert status == 200, raw
    return parse(raw.decode())


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition"):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
