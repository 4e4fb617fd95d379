"""`hybrid serve` as a user runs it: flags checked before anything loads, one line with the URL once loaded,
/health 503 while loading, answers, and a clean stop on Ctrl-C (SIGINT) or SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from serve_helpers import get, post  # noqa: E402

from hybrid.server.running import HttpThread
from hybrid.server.state import ServerConfig, ServerState

ROOT = Path(__file__).resolve().parents[1]


def hybrid(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args,words", [
    (["--port", "70000"], "0 to 65535"),
    (["--reasoning-format", "loud"], "none, deepseek, auto"),
    (["--cache-ram", "lots"], "give a size"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file"),
    (["--api-key", "a", "--api-key-file", "/etc/hostname"], "not both"),
    (["-np", "0"], "-np"),
    (["-np", "2", "--spec-type", "ngram"], "give -np 1"),
])
def test_bad_flags_are_usage_errors(args, words):
    r = hybrid("serve", "/nonexistent.gguf", *args)
    flat = " ".join(re.sub("[\u2500-\u257f]", " ", r.stderr).split())  # typer's box drawn around the message
    assert r.returncode == 2 and words in flat, r.stderr


def test_health_is_503_while_loading():
    http = HttpThread(ServerState(ServerConfig(alias="m")), "127.0.0.1", 0)
    http.start()
    try:
        status, _, raw = get(http.url, "/health")
        assert status == 503 and json.loads(raw)["error"]["message"] == "Loading model"
        assert post(http.url, "/v1/chat/completions", {"messages": []})[0] == 503
        assert get(http.url, "/metrics")[0] == 200
    finally:
        http.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_end_to_end(smollm2_model, tmp_path, stop_signal):
    key = tmp_path / "key"
    key.write_text("k3y\n")
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "hybrid", "serve", str(smollm2_model), "--port", str(port), "-c", "512",
                          "--api-key-file", str(key), "-a", "smol"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()  # printed once the model is loaded and warm
        assert f"http://127.0.0.1:{port}/v1" in line and "API key required" in line, (line, p.stderr.read())
        url = f"http://127.0.0.1:{port}"
        assert get(url, "/health")[0] == 200
        assert get(url, "/v1/models")[0] == 401
        status, _, raw = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 3}, {"Authorization": "Bearer k3y"})
        body = json.loads(raw)
        assert status == 200 and body["model"] == "smol" and body["usage"]["completion_tokens"] <= 3
        p.send_signal(stop_signal)
        assert p.wait(timeout=30) == 0
        assert "Traceback" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
