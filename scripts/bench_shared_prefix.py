#!/usr/bin/env python3
"""Prefix sharing across clients: N requests at once that share one long system prompt (different questions after
it), against a `hybrid serve -np K` already running; the prompt tokens the server evaluated (from /metrics) against
one whole prompt plus the other requests' own suffixes (issue 20's bound: at most 1.1x that).

    python3 scripts/bench_shared_prefix.py --url http://127.0.0.1:8080 [-n 16] [--prefix-tokens 2000]

Prints one line of figures (and --json FILE writes them).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

FILLER = ("The harbour keeps a long record of ships, storms, cargoes and the people who worked its quays through "
          "every season of the year. ")


def call(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=900)
    conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, r.read()
    conn.close()
    return out


def metrics(url: str) -> dict[str, float]:
    status, raw = call(url, "GET", "/metrics")
    if status != 200:
        raise SystemExit(f"error: {url}/metrics answered {status}")
    out = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def n_tokens(url: str, text: str) -> int:
    status, raw = call(url, "POST", "/tokenize", {"content": text, "add_special": True})
    return len(json.loads(raw)["tokens"]) if status == 200 else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("-n", type=int, default=16, help="requests, all sent at once")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    words = FILLER.split()
    system, i = "", 0
    while n_tokens(args.url, system) < args.prefix_tokens:
        system += " ".join(words[i % len(words):] + words[:i % len(words)]) + " "
        i += 7
    prompts = [f"{system}\nQuestion {k}: what is {k} times {k + 3}? Answer:" for k in range(args.n)]
    lens = [n_tokens(args.url, p) for p in prompts]
    shared = n_tokens(args.url, system) - 1
    before = metrics(args.url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.n) as pool:
        statuses = list(pool.map(lambda p: call(args.url, "POST", "/v1/completions",
                                               {"prompt": p, "max_tokens": 4, "temperature": 0})[0], prompts))
    wall = time.perf_counter() - t0
    after = metrics(args.url)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("hybrid_prompt_tokens_evaluated",
                                                             "hybrid_prompt_tokens_reused",
                                                             "hybrid_prompt_tokens_copied")}
    bound = lens[0] + sum(n - shared for n in lens[1:])
    row = {"requests": args.n, "ok": statuses.count(200), "prompt_tokens_each": lens[0], "shared_tokens": shared,
           "evaluated": d["hybrid_prompt_tokens_evaluated"], "reused": d["hybrid_prompt_tokens_reused"],
           "copied": d["hybrid_prompt_tokens_copied"], "one_prompt_plus_suffixes": bound,
           "ratio": d["hybrid_prompt_tokens_evaluated"] / bound, "wall_s": wall}
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))
    return 0 if row["ok"] == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
