#!/usr/bin/env python3
"""One decode step of B one-token sequences (Engine.eval_batch) on the CPU, three ways alternated in one process:
paged caches of one pool attending in one call a layer, the same with a call a sequence, and contiguous caches.

    python3 scripts/bench_paged_batch.py [-m MODEL] [-b 4] [--depth 32] [--rounds 5] [--steps 40] [-t 2]

Prints each way's ms a step per round and the medians (the machine's noise: compare within a round)."""

from __future__ import annotations

import argparse
import statistics
import time

from hybrid.engine.launch import launch
from hybrid.engine.params import EngineParams
from hybrid.kv.paged import PagedKV
from hybrid.model.files import resolve_model
from hybrid.model.packaged import default_cache_dir
from kernels_cpu import attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="demo")
    ap.add_argument("-b", "--batch", type=int, default=4)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    engine, _ = launch(resolve_model(a.model), EngineParams(n_ctx=2048, n_threads=a.threads),
                       default_cache_dir(), lambda msg: None)
    engine.warmup()
    one_call = attention.seq_rows

    def per_sequence(*args):
        return attention.BatchRows(one_call(*args).per_seq)

    def caches(paged: bool):
        n_ctx = a.depth + a.steps * 2 + 64
        if paged:
            kv = PagedKV(engine.config, engine.backends, a.batch * (-(-n_ctx // 64)), 64)
            seqs = [kv.sequence(n_ctx) for _ in range(a.batch)]
        else:
            seqs = [engine.new_cache(n_ctx, paged=False) for _ in range(a.batch)]
        for i, s in enumerate(seqs):
            engine.eval(list(range(10 + i, 10 + i + a.depth)), s)
        return seqs

    ways = {"paged, one call a layer": (True, one_call), "paged, a call a sequence": (True, per_sequence),
            "contiguous": (False, one_call)}
    ms: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(a.rounds):
        for w, (paged, rows) in ways.items():
            attention.seq_rows = rows
            seqs = caches(paged)
            for step in range(a.steps + 3):
                if step == 3:
                    t0 = time.perf_counter()
                engine.eval_batch([([5 + i], s) for i, s in enumerate(seqs)])
            ms[w].append((time.perf_counter() - t0) / a.steps * 1000)
    attention.seq_rows = one_call
    for w, v in ms.items():
        print(f"{w}: {' '.join(f'{x:.2f}' for x in v)} ms a step, median {statistics.median(v):.2f}")


if __name__ == "__main__":
    main()
