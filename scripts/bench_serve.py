#!/usr/bin/env python3
"""Latency of an OpenAI-compatible server, as vLLM's benchmarks/serve.py measures it: TTFT, TPOT
((e2e - TTFT) / (n_out - 1)), ITL (the gaps between streamed chunks) and E2E latency, mean / median / P99, and
output tokens/s, at each concurrency; then a chat's second turn over a shared ~1,000-token prefix (prompt cache),
and `hybrid run`'s own prompt and eval rates on the same model for comparison.

    python3 scripts/bench_serve.py [-m MODEL] [-c 1,4] [--requests 8] [--prompt-tokens 128] [--max-tokens 64]
    python3 scripts/bench_serve.py --url http://127.0.0.1:8080 --label llama-server   # a server already running
                                                                  # (hybrid serve, llama-server, any OpenAI server)

Without --url it starts `hybrid serve MODEL` on a free loopback port (and stops it). Talks only to that URL.
Prints markdown tables; --json FILE writes every figure.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from hybrid.server.metrics import parse as parse_metrics

ROOT = Path(__file__).resolve().parents[1]
FILLER = ("The history of the city is long and full of changes: its markets, its rivers, its bridges and the people "
          "who crossed them every morning on their way to work, in every season of the year. ")


def stream(url: str, path: str, body: dict) -> dict:
    """One streamed request: send time, the arrival time of each chunk with text, the usage."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    t0 = time.perf_counter()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{path}: HTTP {r.status}: {r.read()[:300]!r}")
    arrivals, usage = [], None
    for chunk in sse_chunks(r):
        usage = chunk.get("usage") or usage
        arrivals += [time.perf_counter()] * has_text(chunk)
    conn.close()
    return {"t0": t0, "arrivals": arrivals, "end": time.perf_counter(), "usage": usage or {}}


def sse_chunks(r):
    """The JSON chunks of a streamed response's `data:` lines, in order (until [DONE] or the end)."""
    while True:
        line = r.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def has_text(chunk: dict) -> int:
    """How many of a chunk's choices carry text (a completion's, or a chat delta's content or reasoning)."""
    return sum(bool(c.get("text") or (c.get("delta") or {}).get("content")
                    or (c.get("delta") or {}).get("reasoning_content")) for c in chunk.get("choices") or [])


def summarize(results: list[dict], wall_s: float) -> dict:
    ttft, tpot, itl, e2e, n_out = [], [], [], [], 0
    for r in results:
        if not r["arrivals"]:
            continue
        first = r["arrivals"][0] - r["t0"]
        total = r["end"] - r["t0"]
        n = r["usage"].get("completion_tokens", len(r["arrivals"]))
        n_out += n
        ttft.append(first * 1000)
        e2e.append(total * 1000)
        if n > 1:
            tpot.append((total - first) * 1000 / (n - 1))
        itl += [(b - a) * 1000 for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    out = {"requests": len(results), "output_tokens": n_out, "wall_s": wall_s,
           "output_tok_s": n_out / wall_s if wall_s > 0 else 0.0}
    for name, xs in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        xs = sorted(xs)
        out[name] = {"mean": statistics.fmean(xs) if xs else 0.0, "median": statistics.median(xs) if xs else 0.0,
                     "p99": xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else 0.0}
    return out


def prompt_text(i: int, n_tokens: int) -> str:
    """A distinct prompt of roughly n_tokens tokens (distinct from its first words, so no cache is shared)."""
    words = max(1, int(n_tokens / 1.3))
    text = (f"Request {i}. " + FILLER * (words // len(FILLER.split()) + 1)).split()
    return " ".join(text[:words])


WORKER = ("steps_total", "step_seconds_total", "eval_seconds", "deliver_seconds_total")
DECODE = ("decode_steps", "decode_eval_seconds")  # a server of this tree's (optional: older ones lack them)


def get_text(url: str, path: str) -> tuple[int, str]:
    """GET url + path -> (HTTP status, body text); OSError where the server cannot be reached."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def worker_counters(url: str) -> dict[str, float]:
    """The batched worker's counters from /metrics (hybrid_worker_*; empty for a server without them)."""
    try:
        status, text = get_text(url, "/metrics")
    except OSError:
        return {}
    samples = parse_metrics(text) if status == 200 else {}
    return {k: samples[f"hybrid_worker_{k}"] for k in WORKER + DECODE if f"hybrid_worker_{k}" in samples}


def worker_split(before: dict, after: dict, wall_s: float) -> dict | None:
    """ms a step of the worker's steps during a level: in eval_batch, the rest of the step (planning, sampling),
    delivering the tokens, and the wall time between steps' starts (admission and waiting included); and the
    steps without prompt rows (decode_steps) with their ms in eval_batch."""
    if any(k not in before or k not in after for k in WORKER):
        return None
    d = {k: after[k] - before[k] for k in WORKER + DECODE if k in before and k in after}
    n = d["steps_total"]
    if n <= 0:
        return None
    out = {"steps": int(n), "eval_ms": 1000 * d["eval_seconds"] / n,
           "step_rest_ms": 1000 * (d["step_seconds_total"] - d["eval_seconds"]) / n,
           "deliver_ms": 1000 * d["deliver_seconds_total"] / n, "wall_ms": 1000 * wall_s / n}
    if d.get("decode_steps", 0) > 0:
        out.update(decode_steps=int(d["decode_steps"]),
                   decode_eval_ms=1000 * d["decode_eval_seconds"] / d["decode_steps"])
    return out


def run_level(url: str, concurrency: int, requests: int, prompt_tokens: int, max_tokens: int) -> dict:
    bodies = [{"prompt": prompt_text(i, prompt_tokens), "max_tokens": max_tokens, "temperature": 0,
               "cache_prompt": False} for i in range(requests)]
    before = worker_counters(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda b: stream(url, "/v1/completions", b), bodies))
    out = summarize(results, time.perf_counter() - t0)
    out["worker"] = worker_split(before, worker_counters(url), out["wall_s"])
    return out


def prefix_turns(url: str, prefix_tokens: int) -> dict:
    """A chat over a long shared system prompt: TTFT of the first turn, then of the second (prefix cached)."""
    system = {"role": "system", "content": prompt_text(10_000, prefix_tokens)}
    ask = {"role": "user", "content": "Summarize the text above in one sentence."}
    first = stream(url, "/v1/chat/completions", {"messages": [system, ask], "max_tokens": 16, "temperature": 0})
    reply = {"role": "assistant", "content": "It is about a city."}
    more = {"role": "user", "content": "And what about its rivers?"}
    second = stream(url, "/v1/chat/completions", {"messages": [system, ask, reply, more], "max_tokens": 16,
                                                  "temperature": 0})
    t1, t2 = (r["arrivals"][0] - r["t0"] for r in (first, second))
    return {"prompt_tokens": first["usage"].get("prompt_tokens"), "ttft1_ms": t1 * 1000, "ttft2_ms": t2 * 1000,
            "cached_tokens": (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"),
            "ratio": t2 / t1 if t1 > 0 else 0.0}


SERVE_ONLY = ("-np", "--parallel", "--host", "--port", "--api-key", "--cache-ram")  # flags `hybrid run` lacks


def run_flags(args: list[str]) -> list[str]:
    """The --server-args that `hybrid run` takes too: each SERVE_ONLY flag is dropped with its value."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in SERVE_ONLY:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in SERVE_ONLY)):
            out.append(a)
    return out


def run_rates(model: str, prompt_tokens: int, max_tokens: int, args: list[str]) -> dict:
    """`hybrid run --json`: its own prompt-eval and eval rates for the same prompt size."""
    cmd = [sys.executable, "-m", "hybrid", "run", model, "-p", prompt_text(0, prompt_tokens), "-n", str(max_tokens),
           "--temp", "0", "--json", *run_flags(args)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=True)
    t = json.loads(out.stdout)["timings"]
    return {"prompt_n": t["prompt_n"], "prompt_per_second": t["prompt_per_second"],
            "predicted_per_second": t["predicted_per_second"],
            "ttft_ms": 1000 * t["prompt_n"] / t["prompt_per_second"] if t["prompt_per_second"] else 0.0,
            "tpot_ms": 1000 / t["predicted_per_second"] if t["predicted_per_second"] else 0.0}


def start_server(model: str, args: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "hybrid", "serve", model, "--port", str(port), *args], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if f":{port}" not in line:
        p.kill()
        raise RuntimeError(f"hybrid serve did not start: {line!r}")
    threading.Thread(target=p.stdout.read, daemon=True).start()
    return p, f"http://127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="smollm2", help="model for hybrid serve / hybrid run (default smollm2)")
    ap.add_argument("--url", help="an already running server (skips starting one and the `hybrid run` rates)")
    ap.add_argument("--label", help="the server's name in the output (default: hybrid serve, or the URL)")
    ap.add_argument("-c", "--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=1000, help="shared prefix of the two-turn test (0: skip)")
    ap.add_argument("--server-args", default="", help="extra flags for hybrid serve and hybrid run, e.g. '-t 2'")
    ap.add_argument("--json", dest="json_out", help="write every figure to this file")
    a = ap.parse_args()
    extra = a.server_args.split()
    proc, url = (None, a.url) if a.url else start_server(a.model, extra)
    label = a.label or ("hybrid serve" if not a.url else url)
    report: dict = {"label": label, "url": url, "levels": {}}
    try:
        stream(url, "/v1/completions", {"prompt": "warm up", "max_tokens": 4})
        for c in (int(x) for x in a.concurrency.split(",")):
            report["levels"][c] = run_level(url, c, a.requests, a.prompt_tokens, a.max_tokens)
        if a.prefix_tokens:
            report["prefix"] = prefix_turns(url, a.prefix_tokens)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if not a.url:
        report["hybrid_run"] = run_rates(a.model, a.prompt_tokens, a.max_tokens, extra)
    print(f"\n{label}: {a.requests} requests per level, ~{a.prompt_tokens} prompt tokens, max_tokens {a.max_tokens},"
          f" {url}\n")
    print("| server | concurrency | TTFT mean / median / P99 ms | TPOT mean / median / P99 ms | ITL mean / median / P99 ms "
          "| E2E mean / median / P99 ms | output tok/s |")
    print("|---|---|---|---|---|---|---|")
    for c, s in report["levels"].items():
        cells = [" / ".join(f"{s[k][q]:.1f}" for q in ("mean", "median", "p99"))
                 for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")]
        print(f"| {label} | {c} | " + " | ".join(cells) + f" | {s['output_tok_s']:.1f} |")
    one = report["levels"].get(1)
    if one and len(report["levels"]) > 1:  # each level's throughput against one stream's (the batching issue's ratios)
        print("output tok/s against concurrency 1: " + ", ".join(
            f"{c}: {s['output_tok_s'] / one['output_tok_s']:.2f}x" for c, s in report["levels"].items() if c != 1))
    for c, s in report["levels"].items():
        w = s.get("worker")
        if w:
            print(f"worker at concurrency {c}: {w['steps']} steps, ms a step: eval_batch {w['eval_ms']:.2f}, rest of "
                  f"the step {w['step_rest_ms']:.2f}, delivery {w['deliver_ms']:.2f}, wall {w['wall_ms']:.2f}"
                  + (f"; {w['decode_steps']} steps without prompt rows: eval_batch {w['decode_eval_ms']:.2f}"
                     if "decode_steps" in w else ""))
    if "hybrid_run" in report:
        r = report["hybrid_run"]
        print(f"\nhybrid run, same prompt: prompt {r['prompt_n']} tokens at {r['prompt_per_second']:.1f} t/s "
              f"(TTFT equivalent {r['ttft_ms']:.1f} ms), eval {r['predicted_per_second']:.1f} t/s "
              f"(TPOT equivalent {r['tpot_ms']:.1f} ms)")
    if "prefix" in report:
        p = report["prefix"]
        print(f"\nshared prefix: first turn {p['prompt_tokens']} prompt tokens, TTFT {p['ttft1_ms']:.1f} ms; "
              f"second turn TTFT {p['ttft2_ms']:.1f} ms ({p['cached_tokens']} cached), ratio {p['ratio']:.3f}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
