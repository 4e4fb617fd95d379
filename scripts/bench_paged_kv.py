#!/usr/bin/env python3
"""pp and tg through the paged KV cache `run` uses (Engine.new_cache: a sequence with a pool of its own, read through
a block table) against the contiguous cache it replaced, alternated in one process on one loaded model.

    python3 scripts/bench_paged_kv.py [-m MODEL] [-p 512] [-n 128] [-ngl 0] [-t 0] [--rounds 3] [-r 2] [ENGINE FLAGS]
        [--paired 64,512]

Each round runs both caches (the order alternating), each with `-r` repetitions of llama-bench's tests
(hybrid.tools.bench); prints tokens/s per round and cache, then the mean ratio paged / contiguous per test.
--paired DEPTHS: then, at each depth, decode steps alternating between a paged and a contiguous cache holding the
same prompt (300 pairs): the median ms a step of each, what a noisy machine still compares."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from hybrid.engine.launch import launch
from hybrid.engine.params import EngineParams
from hybrid.model.files import resolve_model
from hybrid.model.packaged import default_cache_dir
from hybrid.plan.overrides import build_overrides
from hybrid.system.devices import probe_machine
from hybrid.system.sizes import parse_size
from hybrid.tools.bench import run_bench, tests_from


def engine_args(description: str, ngl: str = "0", n_gen: int = 128, reps: int = 2,
                vram_budget: str = "") -> argparse.ArgumentParser:
    """The flags of a benchmark script that loads one engine and runs llama-bench's pp and tg tests on it (this
    script's and scripts/gpu_pool_check.py's)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("-m", "--model", default="demo")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=n_gen)
    ap.add_argument("-ngl", "--n-gpu-layers", default=ngl)
    ap.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("-ctk", "--cache-type-k", default="f16")
    ap.add_argument("-ctv", "--cache-type-v", default="f16")
    ap.add_argument("--vram-budget", default=vram_budget, help="'' for none")
    ap.add_argument("-c", "--ctx-size", type=int, default=0, help="the engine's -c (0: what the tests need)")
    ap.add_argument("-r", "--repetitions", type=int, default=reps)
    return ap


def load(a: argparse.Namespace, n_ctx: int):
    """(the engine engine_args' flags ask for, with a context of n_ctx (or -c where given), its EngineParams)."""
    params = EngineParams(n_ctx=max(a.ctx_size, n_ctx), n_threads=a.threads, n_gpu_layers=a.n_gpu_layers,
                          type_k=a.cache_type_k, type_v=a.cache_type_v, op_offload=True,
                          overrides=build_overrides((), False, a.n_cpu_moe),
                          vram_budget=parse_size(a.vram_budget) if a.vram_budget else None)
    engine, _ = launch(resolve_model(a.model), params, default_cache_dir(), lambda msg: None)
    return engine, params


def main() -> None:
    ap = engine_args(__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paired", default="", help="depths for paired decode steps, comma-separated")
    a = ap.parse_args()
    depths = [int(d) for d in a.paired.split(",") if d]
    engine, params = load(a, max([a.n_prompt + a.n_gen, *depths]) + 64)
    machine = probe_machine()
    print(f"CPU: {machine.cpu_model}, {machine.physical_cores} cores; GPU: "
          f"{', '.join(g.name for g in machine.gpus) or 'none'}; model {a.model}, -ngl {a.n_gpu_layers}, "
          f"-ncmoe {a.n_cpu_moe}, -t {a.threads or machine.physical_cores}")
    tests = tests_from([a.n_prompt], [a.n_gen], [])
    ts: dict[tuple[str, bool], list[float]] = {}
    print("| round | cache | " + " | ".join(f"{t.name} t/s" for t in tests) + " |")
    print("|---|---|" + "---:|" * len(tests))
    for rnd in range(a.rounds):
        for paged in ((True, False) if rnd % 2 == 0 else (False, True)):
            engine.params = replace(params, kv_paged=paged)
            row = [r.avg_ts for r in run_bench(engine, tests, a.repetitions, warmup=rnd < 2)]
            for t, v in zip(tests, row):
                ts.setdefault((t.name, paged), []).append(v)
            name = "paged" if paged else "contiguous"
            print(f"| {rnd + 1} | {name} | " + " | ".join(f"{v:.2f}" for v in row) + " |", flush=True)
    for t in tests:
        p, c = statistics.fmean(ts[t.name, True]), statistics.fmean(ts[t.name, False])
        print(f"{t.name}: paged {p:.2f} t/s, contiguous {c:.2f} t/s, ratio {p / c:.3f}")
    for depth in depths:
        a_ms, b_ms = paired_steps(engine, depth)
        print(f"decode at depth {depth}, paired: paged {a_ms:.3f} ms, contiguous {b_ms:.3f} ms a step, "
              f"time ratio {a_ms / b_ms:.3f}")
    engine.close()


def paired_steps(engine, depth: int, n: int = 300) -> tuple[float, float]:
    """Median ms of a decode step on a paged and on a contiguous cache, the two alternating step by step."""
    caches = {p: engine.new_cache(depth + n + 8, paged=p) for p in (True, False)}
    for c in caches.values():
        engine.eval([5 + i % 97 for i in range(depth)], c)
    ms: dict[bool, list[float]] = {True: [], False: []}
    for i in range(n):
        for p in ((True, False) if i % 2 else (False, True)):
            t0 = time.perf_counter()
            engine.eval([7 + i % 50], caches[p])
            ms[p].append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ms[True]), statistics.median(ms[False])


if __name__ == "__main__":
    main()
