#!/usr/bin/env python3
"""Soak test of `hybrid serve` (the serving issue's reliability check): rounds of requests from many concurrent
clients on loopback with random prompt and output lengths, random client disconnects mid-stream and a few oversized
prompts. Every request must get its complete answer or a clean error; after each round the slots and KV blocks must
be back in the free pool (/metrics), and the server's RSS and VRAM must stay stable from round to round.

    python3 scripts/serve_soak.py [-m MODEL] [--server-args "-np 8 -c 4096 -t 2"] [--requests 200] [--clients 32]
                                  [--rounds 2] [--disconnect 0.15] [--oversized 0.03] [--prompt-tokens 4,300]
                                  [--max-tokens 1,64] [--seed 0] [--json FILE]
    python3 scripts/serve_soak.py --url http://127.0.0.1:8080      # a server already running (no RSS / VRAM)

Each request follows a plan drawn from (seed, round, index): oversized (a prompt of ~2x the slot context, expects a
4xx with a JSON error), disconnect (streams, reads 0-5 text chunks, then drops the connection) or full; over
/v1/completions or /v1/chat/completions, streamed or not; every 4th prompt starts with part of an earlier one (the
prefix cache). Without --url it starts `hybrid serve MODEL` on a free loopback port and stops it at the end.
Prints a markdown table (one row per round), the first failures and a verdict; exits 0 only when all passed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402

from hybrid.server.metrics import parse as parse_metrics  # noqa: E402

TIMEOUT_S = 300
IDLE_WAIT_S = 60
MIB = 1 << 20
FINISH = ("stop", "length")


# ---- the plan ------------------------------------------------------------------------------------------------------

def make_plans(a, rnd: int, n_ctx: int) -> list[dict]:
    """The round's requests, deterministic in (seed, round, index); built in order so that a prompt can share an
    earlier one's start."""
    plans: list[dict] = []
    for i in range(a.requests):
        plans.append(make_plan(a, rnd, i, n_ctx, plans))
    return plans


def make_plan(a, rnd: int, i: int, n_ctx: int, earlier: list[dict]) -> dict:
    rng = random.Random(f"soak-{a.seed}-{rnd}-{i}")
    uid = rnd * a.requests + i + 1  # distinct prompts across rounds too
    u = rng.random()
    kind = "oversized" if u < a.oversized else "disconnect" if u < a.oversized + a.disconnect else "full"
    plan = {"index": i, "kind": kind, "chat": rng.random() < 0.5, "stream": kind == "disconnect" or rng.random() < 0.5,
            "max_tokens": rng.randint(*a.max_tokens), "seed": rng.randrange(1 << 31), "shared": False,
            "chunks": rng.randint(0, 5), "rst": rng.random() < 0.5}
    if kind == "oversized":
        plan["prompt"] = bench_serve.prompt_text(uid, 2 * n_ctx)
        return plan
    plan["prompt"] = bench_serve.prompt_text(uid, rng.randint(*a.prompt_tokens))
    base = shared_base(rng, i, earlier)
    if base is not None:
        words = base.split()
        keep = max(1, int(len(words) * rng.uniform(0.5, 0.9)))
        plan["prompt"] = " ".join(words[:keep] + [f"Follow-up {uid}:", "and", "then?"])
        plan["shared"] = True
    return plan


def shared_base(rng: random.Random, i: int, earlier: list[dict]) -> str | None:
    """Every 4th request: the prompt of one of the three before it (when that one is not oversized)."""
    if i % 4 != 3:
        return None
    j = i - rng.randint(1, 3)
    return earlier[j]["prompt"] if earlier[j]["kind"] != "oversized" else None


def request_body(plan: dict) -> tuple[str, dict]:
    body = {"max_tokens": plan["max_tokens"], "temperature": 0.7, "seed": plan["seed"], "stream": plan["stream"]}
    if plan["stream"]:
        body["stream_options"] = {"include_usage": True}
    if plan["chat"]:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": plan["prompt"]}]}
    return "/v1/completions", {**body, "prompt": plan["prompt"]}


# ---- one request ---------------------------------------------------------------------------------------------------

class DoneTap:
    """Wraps a response for bench_serve.sse_chunks, noting whether `data: [DONE]` came."""

    def __init__(self, r):
        self.r, self.done = r, False

    def readline(self):
        line = self.r.readline()
        self.done |= line.strip() == b"data: [DONE]"
        return line


def run_one(url: str, plan: dict) -> dict:
    """Sends one planned request; {"ok", "reason", "tokens", "seconds", ...}. Never raises."""
    path, body = request_body(plan)
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT_S)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        check = {"oversized": check_oversized, "disconnect": check_disconnect, "full": check_full}[plan["kind"]]
        ok, reason, tokens = check(conn, r, plan)
    except Exception as e:  # noqa: BLE001  (a timeout, a reset, bad JSON: all failures with their reason)
        ok, reason, tokens = False, f"{type(e).__name__}: {e}", 0
    finally:
        conn.close()
    return {"index": plan["index"], "kind": plan["kind"], "path": path, "stream": plan["stream"], "ok": ok,
            "reason": reason, "tokens": tokens, "seconds": time.perf_counter() - t0}


def check_oversized(conn, r, plan: dict) -> tuple[bool, str, int]:
    data = r.read()
    if not 400 <= r.status < 500:
        return False, f"oversized prompt: HTTP {r.status} (expected 4xx): {data[:200]!r}", 0
    try:
        err = json.loads(data)
    except ValueError:
        return False, f"oversized prompt: HTTP {r.status} with a body that is not JSON: {data[:200]!r}", 0
    if not isinstance(err, dict) or "error" not in err:
        return False, f"oversized prompt: HTTP {r.status} without 'error': {data[:200]!r}", 0
    return True, "", 0


def check_disconnect(conn, r, plan: dict) -> tuple[bool, str, int]:
    if r.status != 200:
        return False, f"disconnect: HTTP {r.status}: {r.read()[:200]!r}", 0
    seen = 0
    if plan["chunks"] > 0:
        for chunk in bench_serve.sse_chunks(r):
            if "error" in chunk:
                return False, f"disconnect: error event in the stream: {str(chunk)[:200]}", seen
            seen += bench_serve.has_text(chunk)
            if seen >= plan["chunks"]:
                break
    drop(conn, plan["rst"])
    return True, "", seen


def drop(conn, rst: bool) -> None:
    """Closes the connection abruptly: an RST (SO_LINGER 0) or a shutdown of both directions."""
    if conn.sock is None:
        return
    if rst:
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    else:
        conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def check_full(conn, r, plan: dict) -> tuple[bool, str, int]:
    if r.status != 200:
        return False, f"HTTP {r.status}: {r.read()[:200]!r}", 0
    if plan["stream"]:
        return check_stream(r, plan)
    data = json.loads(r.read())
    finish = ((data.get("choices") or [{}])[0]).get("finish_reason")
    return check_finish(finish, data.get("usage") or {}, plan, "")


def check_stream(r, plan: dict) -> tuple[bool, str, int]:
    tap, finish, usage = DoneTap(r), None, {}
    for chunk in bench_serve.sse_chunks(tap):
        if "error" in chunk:
            return False, f"error event in the stream: {str(chunk)[:200]}", 0
        usage = chunk.get("usage") or usage
        finish = next((c["finish_reason"] for c in chunk.get("choices") or [] if c.get("finish_reason")), finish)
    if not tap.done:
        return False, f"stream ended without data: [DONE] (finish_reason {finish})", 0
    return check_finish(finish, usage, plan, "stream: ")


def check_finish(finish, usage: dict, plan: dict, where: str) -> tuple[bool, str, int]:
    n = usage.get("completion_tokens")
    if finish not in FINISH:
        return False, f"{where}finish_reason {finish!r}", n or 0
    if n is None:
        return (True, "", 0) if plan["stream"] else (False, "no usage.completion_tokens", 0)
    if n > plan["max_tokens"] or (finish == "length" and n < 1):
        return False, f"{where}completion_tokens {n} with max_tokens {plan['max_tokens']}, finish {finish}", n
    return True, "", n


# ---- the server's state --------------------------------------------------------------------------------------------

def get_metrics(url: str) -> dict[str, float]:
    status, text = bench_serve.get_text(url, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics: HTTP {status}: {text[:200]}")
    return {k.removeprefix("hybrid_"): v for k, v in parse_metrics(text).items()}


def wait_idle(url: str) -> tuple[dict, float]:
    """Polls /metrics until no slot is busy and nothing runs or waits (at most IDLE_WAIT_S): (gauges, seconds)."""
    t0 = time.perf_counter()
    while True:
        try:
            m = get_metrics(url)
        except (OSError, RuntimeError, http.client.HTTPException) as e:
            return {"error": f"/metrics: {type(e).__name__}: {e}"}, time.perf_counter() - t0
        if is_idle(m) or time.perf_counter() - t0 > IDLE_WAIT_S:
            return m, time.perf_counter() - t0
        time.sleep(0.25)


def is_idle(m: dict) -> bool:
    return all(m.get(k, 0) == 0 for k in ("slots_busy", "requests_processing", "requests_deferred"))


def leaks(m: dict) -> list[str]:
    """What /metrics says is not back in the free pool."""
    if "error" in m:
        return [m["error"]]
    out = [f"{k} = {m[k]:g}" for k in ("slots_busy", "requests_processing", "requests_deferred", "kv_cache_busy_cells")
           if m.get(k, 0) != 0]
    if "kv_blocks_total" in m:
        free, prefix, total = m["kv_blocks_free"], m.get("prefix_cache_blocks", 0), m["kv_blocks_total"]
        if free + prefix != total:
            out.append(f"kv blocks: free {free:g} + prefix cache {prefix:g} != total {total:g}")
    return out


def server_pids(pid: int) -> list[int]:
    import psutil
    p = psutil.Process(pid)
    return [pid] + [c.pid for c in p.children(recursive=True)]


def rss_mib(pid: int) -> float:
    import psutil
    total = 0
    for q in server_pids(pid):
        try:
            total += psutil.Process(q).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / MIB


def vram_mib(pid: int) -> float | None:
    """GPU memory the server's processes use (nvidia-smi), or None where unknown."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return None
    pids, used = set(server_pids(pid)), 0.0
    for line in out.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and int(fields[0]) in pids:
            used += float(fields[1]) if fields[1].replace(".", "", 1).isdigit() else 0.0
    return used


# ---- a round -------------------------------------------------------------------------------------------------------

def run_round(a, url: str, pid: int | None, rnd: int, n_ctx: int) -> dict:
    plans = make_plans(a, rnd, n_ctx)
    results, done = [], threading.Lock()
    t0 = time.perf_counter()

    def task(plan):
        res = run_one(url, plan)
        with done:
            results.append(res)
            if len(results) % 25 == 0 or len(results) == len(plans):
                print(f"round {rnd + 1}: {len(results)}/{len(plans)} done, {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr)
        return res

    with ThreadPoolExecutor(a.clients) as pool:
        list(pool.map(task, plans))
    wall = time.perf_counter() - t0
    m, idle_s = wait_idle(url)
    return summarize_round(rnd, plans, sorted(results, key=lambda r: r["index"]), wall, m, idle_s, pid)


def summarize_round(rnd, plans, results, wall, m, idle_s, pid) -> dict:
    def count(kind):
        return sum(r["ok"] for r in results if r["kind"] == kind)

    failures = [f"round {rnd + 1} #{r['index']} {r['kind']} {r['path']}{' stream' if r['stream'] else ''}: "
                f"{r['reason']}" for r in results if not r["ok"]]
    blocks = None
    if "kv_blocks_total" in m:
        blocks = {"free": m["kv_blocks_free"], "prefix": m.get("prefix_cache_blocks", 0), "total": m["kv_blocks_total"]}
    return {"round": rnd + 1, "requests": len(results), "planned": {k: sum(p["kind"] == k for p in plans)
                                                                     for k in ("full", "disconnect", "oversized")},
            "shared_prefix": sum(p["shared"] for p in plans), "full_ok": count("full"),
            "disconnect_ok": count("disconnect"), "oversized_rejected": count("oversized"), "failures": failures,
            "output_tokens": sum(r["tokens"] for r in results if r["kind"] == "full"), "wall_s": wall,
            "idle_after_s": idle_s, "leaks": leaks(m), "blocks": blocks, "metrics": m,
            "rss_mib": rss_mib(pid) if pid else None, "vram_mib": vram_mib(pid) if pid else None,
            "results": results}


# ---- the verdict and the report ------------------------------------------------------------------------------------

def verdict(rounds: list[dict]) -> str:
    """'' when everything passed, else the first reason in one line."""
    if not rounds:
        return "no rounds ran"
    for r in rounds:
        if r["failures"]:
            return f"round {r['round']}: {len(r['failures'])} failed requests"
        if r["leaks"]:
            return f"round {r['round']}: not back to idle / leak: {'; '.join(r['leaks'])}"
    first = rounds[0]
    for r in rounds[1:]:
        if first["rss_mib"] is not None and r["rss_mib"] is not None:
            tol = max(0.05 * first["rss_mib"], 64)
            if abs(r["rss_mib"] - first["rss_mib"]) > tol:
                return f"RSS moved {first['rss_mib']:.0f} -> {r['rss_mib']:.0f} MiB (round {r['round']}, tol {tol:.0f})"
        if first["vram_mib"] is not None and r["vram_mib"] is not None and abs(r["vram_mib"] - first["vram_mib"]) > 64:
            return f"VRAM moved {first['vram_mib']:.0f} -> {r['vram_mib']:.0f} MiB (round {r['round']}, tol 64)"
    return ""


def fmt(v, spec=".0f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_report(a, url: str, n_ctx: int, rounds: list[dict], reason: str) -> None:
    print(f"\nsoak: {a.requests} requests x {len(rounds)} rounds, {a.clients} clients, {url}, slot context {n_ctx}, "
          f"prompt tokens {a.prompt_tokens[0]}-{a.prompt_tokens[1]}, max_tokens {a.max_tokens[0]}-{a.max_tokens[1]}, "
          f"disconnect {a.disconnect}, oversized {a.oversized}, seed {a.seed}\n")
    print("| round | requests | full ok | disconnects | oversized rejected | failures | output tokens | wall s "
          "| RSS MiB | VRAM MiB | blocks free+prefix/total |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rounds:
        p, b = r["planned"], r["blocks"]
        blocks = "n/a" if b is None else f"{b['free']:.0f}+{b['prefix']:.0f}/{b['total']:.0f}"
        print(f"| {r['round']} | {r['requests']} | {r['full_ok']}/{p['full']} | {r['disconnect_ok']}/{p['disconnect']} "
              f"| {r['oversized_rejected']}/{p['oversized']} | {len(r['failures'])} | {r['output_tokens']} "
              f"| {r['wall_s']:.1f} | {fmt(r['rss_mib'])} | {fmt(r['vram_mib'])} | {blocks} |")
    failures = [f for r in rounds for f in r["failures"]] + [f"round {r['round']}: {x}" for r in rounds
                                                             for x in r["leaks"]]
    if failures:
        print(f"\nfirst failures ({len(failures)} in all):")
        for f in failures[:10]:
            print(f"- {f}")
    print(f"\nverdict: {'PASS' if not reason else 'FAIL: ' + reason}")


# ---- main ----------------------------------------------------------------------------------------------------------

def int_range(s: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in s.split(","))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 < LO <= HI: {s!r}")
    return lo, hi


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="demo", help="model for hybrid serve (default demo)")
    ap.add_argument("--url", help="an already running server (not started or stopped here; no RSS / VRAM)")
    ap.add_argument("--server-args", default="-np 8 -c 4096 -t 2", help="flags for hybrid serve (shlex-split)")
    ap.add_argument("--requests", type=int, default=200, help="requests per round")
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients")
    ap.add_argument("--rounds", type=int, default=2, help="rounds (RSS / VRAM of each later one against the first)")
    ap.add_argument("--disconnect", type=float, default=0.15, help="share of requests that disconnect mid-stream")
    ap.add_argument("--oversized", type=float, default=0.03, help="share of requests with a prompt of ~2x the context")
    ap.add_argument("--prompt-tokens", type=int_range, default=(4, 300), help="LO,HI prompt tokens (approximate)")
    ap.add_argument("--max-tokens", type=int_range, default=(1, 64), help="LO,HI max_tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", help="write every figure to this file")
    return ap.parse_args()


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def slot_context(url: str) -> int | None:
    """A slot's context in tokens (hybrid_n_ctx; 4096 where the server has no such gauge), None without /metrics."""
    try:
        return int(get_metrics(url).get("n_ctx") or 4096)
    except (OSError, RuntimeError, http.client.HTTPException) as e:
        print(f"/metrics: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def main() -> int:
    a = parse_args()
    proc, url = (None, a.url.rstrip("/")) if a.url else bench_serve.start_server(a.model, shlex.split(a.server_args))
    pid = proc.pid if proc is not None else None
    rounds: list[dict] = []
    try:
        n_ctx = slot_context(url)
        if n_ctx is None:
            print(f"verdict: FAIL: cannot read {url}/metrics")
            return 1
        rss0 = rss_mib(pid) if pid else None
        for rnd in range(a.rounds):
            rounds.append(run_round(a, url, pid, rnd, n_ctx))
    finally:
        if proc is not None:
            stop_server(proc)
    reason = verdict(rounds)
    print_report(a, url, n_ctx, rounds, reason)
    if a.json_out:
        report = {"args": vars(a), "url": url, "n_ctx": n_ctx, "rss_before_mib": rss0,
                  "rounds": rounds, "pass": not reason, "reason": reason}
        Path(a.json_out).write_text(json.dumps(report, indent=1))
    return 1 if reason else 0


if __name__ == "__main__":
    sys.exit(main())
