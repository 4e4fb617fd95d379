"""Chunked prefill against running streams: the inter-token latency (ITL) of N decoding streams while one long prompt
prefills, next to the same streams alone, and the long prompt's prefill rate beside them next to alone.

    python3 scripts/bench_chunked.py --url http://127.0.0.1:8080 [--streams 4] [--long-tokens 8000]
                                     [--stream-prompt 128] [--label NAME] [--json FILE]

The server needs N + 1 slots (-np) and a slot context above --long-tokens (-c / -np). Three phases, each on fresh
prompts (no prefix shared, cache_prompt off): (1) the long prompt alone (max_tokens 1): its TTFT, the unchunked
rate; (2) N streams alone: their ITL (the gaps between streamed chunks, the first token excluded) over as many gaps
as phase 3 sees; (3) N streams, and once each has streamed 8 chunks the long prompt: the streams' gaps that overlap
its prefill (from its send to its first token), and its TTFT. Sampling: temperature 0.8, seeded (a stream that ends
early is counted, not replaced). Prints one markdown table; --json writes every figure."""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import has_text, prompt_text, sse_chunks  # noqa: E402


class Stream(threading.Thread):
    """One streamed /v1/completions request in its own thread: the arrival time of each chunk with text."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.t0, self.arrivals, self.error = 0.0, [], None
        self.stop = threading.Event()

    def run(self) -> None:
        u = urlparse(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=900)
        try:
            self.t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body=json.dumps({**self.body, "stream": True}).encode(),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
            for chunk in sse_chunks(r):
                if self.stop.is_set():
                    break
                if has_text(chunk):
                    self.arrivals.append(time.perf_counter())
        except Exception as exc:  # noqa: BLE001 - reported in the output
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()  # a stream stopped early: the server sees its client leave


def body(i: int, n_prompt: int, max_tokens: int) -> dict:
    return {"prompt": prompt_text(i, n_prompt), "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
            "cache_prompt": False}


def stats(gaps_ms: list[float]) -> dict:
    xs = sorted(gaps_ms)
    if not xs:
        return {"n": 0, "median": 0.0, "p99": 0.0, "max": 0.0}
    return {"n": len(xs), "median": statistics.median(xs), "p99": xs[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))],
            "max": xs[-1]}


def gaps(streams: list[Stream], t_from: float = 0.0, t_to: float = float("inf")) -> list[float]:
    """The streams' gaps (ms) after their first chunk that overlap [t_from, t_to]."""
    return [(b - a) * 1000 for s in streams for a, b in zip(s.arrivals[1:], s.arrivals[2:])
            if b >= t_from and a <= t_to]


def start_streams(url: str, n: int, seed: int, n_prompt: int, warm: int) -> list[Stream]:
    streams = [Stream(url, body(seed + i, n_prompt, 100000)) for i in range(n)]
    for s in streams:
        s.start()
    while not all(len(s.arrivals) >= warm or not s.is_alive() for s in streams):
        time.sleep(0.005)
    return streams


def stop(streams: list[Stream]) -> None:
    for s in streams:
        s.stop.set()
    for s in streams:
        s.join(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--label")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--stream-prompt", type=int, default=128)
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    warm = 8

    alone = Stream(a.url, body(1000, a.long_tokens, 1))  # (1) the long prompt alone
    alone.run()
    if alone.error or not alone.arrivals:
        print(f"error: the long prompt alone failed: {alone.error or 'no token'}", file=sys.stderr)
        return 1
    ttft_alone = alone.arrivals[0] - alone.t0

    streams = start_streams(a.url, a.streams, 2000, a.stream_prompt, warm)  # (3) streams + the long prompt
    long = Stream(a.url, body(1001, a.long_tokens, 1))
    long.run()
    stop(streams)
    if long.error or not long.arrivals:
        print(f"error: the long prompt beside the streams failed: {long.error or 'no token'}", file=sys.stderr)
        return 1
    ttft_mixed = long.arrivals[0] - long.t0
    mixed = gaps(streams, long.t0, long.arrivals[0])
    ended = sum(not s.stop.is_set() or s.error is not None for s in streams)

    solo = start_streams(a.url, a.streams, 3000, a.stream_prompt, warm)  # (2) the streams alone, as many gaps
    t_solo = time.perf_counter()
    while len(gaps(solo, t_solo)) < max(len(mixed), 4 * a.streams) and any(s.is_alive() for s in solo):
        time.sleep(0.01)
    stop(solo)
    solo_gaps = gaps(solo, t_solo)

    s_solo, s_mixed = stats(solo_gaps), stats(mixed)
    report = {"label": a.label or a.url, "streams": a.streams, "long_tokens": a.long_tokens,
              "long_ttft_alone_s": ttft_alone, "long_ttft_mixed_s": ttft_mixed,
              "prefill_rate_ratio": ttft_alone / ttft_mixed, "itl_solo_ms": s_solo, "itl_mixed_ms": s_mixed,
              "p99_ratio": s_mixed["p99"] / s_solo["p99"] if s_solo["p99"] else 0.0,
              "p99_over_solo_median": s_mixed["p99"] / s_solo["median"] if s_solo["median"] else 0.0}
    print(f"\n{report['label']}: {a.streams} streams, a ~{a.long_tokens}-token prompt\n")
    print("| ITL solo median / P99 ms | ITL while the long prompt prefills: median / P99 / max ms (gaps) "
          "| P99 / solo P99 | long prompt TTFT alone / beside the streams s | prefill rate beside / alone |")
    print("|---|---|---|---|---|")
    print(f"| {s_solo['median']:.1f} / {s_solo['p99']:.1f} | {s_mixed['median']:.1f} / {s_mixed['p99']:.1f} / "
          f"{s_mixed['max']:.1f} ({s_mixed['n']}) | {report['p99_ratio']:.2f} | {ttft_alone:.2f} / {ttft_mixed:.2f} | "
          f"{report['prefill_rate_ratio']:.2f} |")
    if ended:
        print(f"\n({ended} of the streams ended or failed before the long prompt's first token)")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
