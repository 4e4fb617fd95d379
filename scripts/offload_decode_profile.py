#!/usr/bin/env python3
"""Where a decode token goes when GPU layers keep their routed experts in RAM (`-ngl 99 --n-cpu-moe N`).

    python3 scripts/offload_decode_profile.py MODEL.gguf --n-cpu-moe 24 [-t 16] [--tokens 64] [--moe-cache auto]
        [--vram-budget 12GiB] [--split] [--json OUT.json]

A token is one CUDA graph whose host breaks signal the host and wait for its answer (kernels_gpu.graph; --split:
graph pieces with host calls between them). Per token, in host wall time:
- launch: launching the graph (or the pieces before each host break);
- wait: waiting for the GPU to reach each break (its work, the copies to pinned memory, the signal);
- host: the host calls (HostExperts' CPU experts: Python, the compiled call and its threads);
  of which "cpu kernel": the compiled expert call alone, re-timed on the same inputs after the run;
- after: the host's work after its answers, while the GPU goes on (the expert cache's book and uploads);
- rest: the last piece (the layers after the last break, the output layer), the input and output copies, Python
  of Engine.eval.
With --moe-cache, the cache's host call is split too: validating finished copies, the book, the uploads' launches,
choosing the misses, the CPU kernel on them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def kernel_time(he, reps: int = 20) -> tuple[float, int]:
    """Median seconds of one layer's compiled expert call on its last decode inputs, and how many layers have one."""
    times = []
    fns = [(he._layers[k][1], buf) for k in he._layers if k[1] == "experts"
           for (gid, n), buf in he._pinned.items() if gid == k[0] and n == 1]
    for _ in range(reps):
        for fn, buf in fns:
            t0 = time.perf_counter()
            fn(buf.h, buf.ids, buf.w)
            times.append(time.perf_counter() - t0)
    return (statistics.median(times) if times else 0.0), len(fns)


def time_cache_parts(he) -> dict[str, list]:
    """Wrap the parts of the expert cache's host call (backends/moe_cache/runtime.py) with timers: the validation of
    finished copies, the book's decision, the uploads' launches, the misses' selection, the CPU kernel. Returns
    {part: [seconds, calls]}, updated as the steps run."""
    from hybrid.backends.moe_cache import runtime

    acc: dict[str, list] = {}

    def timed(name, fn):
        acc.setdefault(name, [0.0, 0])

        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name][0] += time.perf_counter() - t0
                acc[name][1] += 1

        return run

    cache = he.cache
    cache._validate = timed("validate", cache._validate)
    cache.book.decode = timed("book", cache.book.decode)
    cache._upload = timed("upload launches", cache._upload)
    runtime.missed = timed("misses", runtime.missed)
    cpu_args = he._cpu_args
    he._cpu_args = lambda *a: timed("cpu kernel", cpu_args(*a))
    return acc


def main() -> int:
    from hybrid.engine import Engine, EngineParams
    from hybrid.plan.overrides import build_overrides
    from hybrid.system.sizes import parse_size

    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--n-cpu-moe", "-ncmoe", type=int, default=24)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--moe-cache", default="0")
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--split", action="store_true", help="host breaks cut the step's graph into pieces (the form "
                    "without unified addressing) instead of signalling inside one graph")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    params = EngineParams(n_ctx=1024, n_gpu_layers="all", n_threads=args.threads,
                          overrides=build_overrides(n_cpu_moe=args.n_cpu_moe), moe_cache=args.moe_cache,
                          vram_budget=parse_size(args.vram_budget) if args.vram_budget else None)
    eng = Engine.load(args.model, params)
    gpu = eng.output_backend
    he = gpu.host_experts
    parts = time_cache_parts(he) if he.cache is not None else None  # before any step captures its host calls
    if args.split:
        from kernels_gpu.graph import GraphRunner

        with gpu.device:
            gpu._graphs = GraphRunner(one_graph=False)
    rng = np.random.default_rng(3)
    cache = eng.new_cache()
    eng.eval(rng.integers(0, eng.config.n_vocab, args.depth), cache)
    tok = int(rng.integers(0, eng.config.n_vocab))
    for _ in range(4):  # eager, captured, replayed
        tok = int(np.argmax(eng.eval([tok], cache)[-1]))
    st = gpu._graphs.stats
    parts_base = {k: tuple(v) for k, v in parts.items()} if parts is not None else {}
    base = (st.pieces, st.piece_launch_s, st.piece_wait_s, st.host_s, he.stats.cpu_seconds, he.stats.cpu_batches,
            st.after_s)
    wall = []
    for _ in range(args.tokens):
        t0 = time.perf_counter()
        tok = int(np.argmax(eng.eval([tok], cache)[-1]))
        wall.append(time.perf_counter() - t0)
    n = args.tokens
    pieces, launch, wait, host, cpu_s, cpu_b, after = (a - b for a, b in zip(
        (st.pieces, st.piece_launch_s, st.piece_wait_s, st.host_s, he.stats.cpu_seconds, he.stats.cpu_batches,
         st.after_s), base))
    total = sum(wall)
    k_s, k_layers = kernel_time(he)
    ms = lambda s: 1e3 * s / n  # noqa: E731 - per token
    summary = {
        "model": str(args.model), "n_cpu_moe": args.n_cpu_moe, "threads": args.threads or "default",
        "breaks": "pieces" if args.split else "one graph",
        "moe_cache": args.moe_cache, "tg_tps": n / total, "ms_per_token": ms(total),
        "median_ms_per_token": 1e3 * statistics.median(wall),
        "breaks_per_token": pieces / n, "launch_ms": ms(launch), "wait_ms": ms(wait), "host_ms": ms(host),
        "host_cpu_calls_ms": ms(cpu_s), "cpu_calls_per_token": cpu_b / n,
        "kernel_alone_us_per_layer": 1e6 * k_s, "kernel_alone_ms_per_token": 1e3 * k_s * k_layers,
        "after_ms": ms(after),
        "rest_ms": ms(total - launch - wait - host - after),
        "per_break_us_outside_kernel": 1e6 * (launch + wait + host + after - k_s * k_layers * n) / max(pieces, 1),
        "graph_report": gpu.graph_report(),
    }
    if parts is not None:  # the expert cache's host call, part by part (ms a token, calls a token)
        for name, (secs, calls) in parts.items():
            summary[f"cache {name} ms"] = ms(secs - parts_base[name][0])
            summary[f"cache {name} calls"] = (calls - parts_base[name][1]) / n
    for k, v in summary.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
