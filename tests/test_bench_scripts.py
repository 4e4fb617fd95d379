"""The pure parts of the serving load scripts: which inter-token gaps scripts/bench_chunked.py counts, its
percentiles, which --server-args scripts/bench_serve.py passes on to `hybrid run` and how it splits the worker's
/metrics counters a step, and scripts/serve_soak.py's leak check and verdict."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_chunked import Stream, gaps, stats  # noqa: E402
from bench_serve import run_flags, worker_split  # noqa: E402


def _stream(times):
    s = Stream("http://127.0.0.1:1", {})
    s.arrivals = list(times)
    return s


def test_gaps_skip_the_first_token_and_keep_those_overlapping_the_window():
    s = _stream([0.0, 1.0, 1.5, 3.0, 3.2, 6.0])  # gaps after the first chunk: 0.5, 1.5, 0.2, 2.8 s
    assert [round(g, 6) for g in gaps([s])] == [500, 1500, 200, 2800]
    window = [round(g, 6) for g in gaps([s], 2.0, 3.1)]  # (1.5, 3.0) and (3.0, 3.2) overlap [2.0, 3.1]
    assert window == [1500, 200]
    assert gaps([s], 7.0, 8.0) == []


def test_stats_median_p99_max():
    xs = [float(i) for i in range(1, 101)]  # 1..100
    st = stats(xs)
    assert st["n"] == 100 and st["median"] == 50.5 and st["max"] == 100.0
    assert st["p99"] == 99.0  # the value at rank round(0.99 * 99) = 98 of the sorted gaps
    assert stats([]) == {"n": 0, "median": 0.0, "p99": 0.0, "max": 0.0}


def test_worker_split_is_ms_a_step_between_two_readings():
    before = {"steps_total": 10, "step_seconds_total": 1.0, "eval_seconds": 0.8, "deliver_seconds_total": 0.1}
    after = {"steps_total": 110, "step_seconds_total": 1.6, "eval_seconds": 1.3, "deliver_seconds_total": 0.15}
    w = worker_split(before, after, 0.8)
    assert w["steps"] == 100
    assert abs(w["eval_ms"] - 5.0) < 1e-9 and abs(w["step_rest_ms"] - 1.0) < 1e-9
    assert abs(w["deliver_ms"] - 0.5) < 1e-9 and abs(w["wall_ms"] - 8.0) < 1e-9
    assert "decode_steps" not in w  # a server without the decode-only counters (an older tree)
    assert worker_split({}, after, 0.8) is None  # a server without the counters (llama-server)
    assert worker_split(after, after, 0.8) is None  # no step in between
    w = worker_split(before | {"decode_steps": 4, "decode_eval_seconds": 0.2},
                     after | {"decode_steps": 84, "decode_eval_seconds": 0.6}, 0.8)
    assert w["decode_steps"] == 80 and abs(w["decode_eval_ms"] - 5.0) < 1e-9


def test_run_flags_drop_the_servers_own():
    args = ["-t", "2", "-np", "4", "-c", "8192", "--port=8080", "--cache-ram", "1GiB", "-b", "256", "--host", "::"]
    assert run_flags(args) == ["-t", "2", "-c", "8192", "-b", "256"]


def test_soak_leaks_and_verdict():
    """scripts/serve_soak.py: what /metrics must say after a round (slots idle, every block free or the prefix
    cache's), and the verdict over rounds (failures, leaks, RSS and VRAM drift beyond their tolerances)."""
    import serve_soak

    idle = {"slots_busy": 0, "requests_processing": 0, "requests_deferred": 0, "kv_cache_busy_cells": 0,
            "kv_blocks_total": 64, "kv_blocks_free": 8, "prefix_cache_blocks": 56}
    assert serve_soak.leaks(idle) == []
    assert serve_soak.leaks({**idle, "kv_blocks_free": 7}) == ["kv blocks: free 7 + prefix cache 56 != total 64"]
    assert serve_soak.leaks({**idle, "slots_busy": 1}) == ["slots_busy = 1"]

    def rnd(i, rss, vram=None, failures=(), leak=()):
        return {"round": i, "failures": list(failures), "leaks": list(leak), "rss_mib": rss, "vram_mib": vram}

    assert serve_soak.verdict([rnd(1, 5000.0, 7700.0), rnd(2, 5200.0, 7750.0)]) == ""  # 4% RSS, 50 MiB VRAM
    assert serve_soak.verdict([rnd(1, 5000.0), rnd(2, 5300.0)]).startswith("RSS moved 5000 -> 5300")
    assert serve_soak.verdict([rnd(1, 500.0, 100.0), rnd(2, 500.0, 200.0)]).startswith("VRAM moved 100 -> 200")
    assert serve_soak.verdict([rnd(1, None), rnd(2, None, failures=["x"])]) == "round 2: 1 failed requests"
    assert "leak" in serve_soak.verdict([rnd(1, None, leak=["slots_busy = 1"])])
    assert serve_soak.verdict([]) == "no rounds ran"
