#!/usr/bin/env python3
"""Each kernel of a GPU decode step of B sequences, timed by Nsight Compute: the step (Engine.eval_batch over paged
caches of one pool, one token each, greedy ids back: a CUDA-graph replay once warm) runs REPEAT times between
cudaProfilerStart and Stop, so that

    ncu --profile-from-start off --graph-profiling node --metrics gpu__time_duration.sum --csv \\
        --log-file K.csv python3 scripts/gpu_step_kernels.py MODEL -b 8 [--depth 256]
    python3 scripts/gpu_step_kernels.py --parse K.csv [--repeat 1]

gives every kernel node's GPU time (each alone: ncu serializes them, so the sum exceeds a replay's time by the
launch gaps it removes and the overlap it forbids); --parse sums them by kernel name, a step's share each.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

import numpy as np


def run(model: str, b: int, depth: int, repeat: int) -> None:
    import cupy  # noqa: PLC0415

    from hybrid.engine import Engine, EngineParams  # noqa: PLC0415
    from hybrid.kv.paged import PagedKV  # noqa: PLC0415

    e = Engine.load(model, EngineParams(n_ctx=8192, n_gpu_layers="all"))
    rng = np.random.default_rng(0)
    room = 64
    kv = PagedKV(e.config, e.backends, b * (depth + room) // 64 + 8, 64, e.params.type_k, e.params.type_v)
    seqs = [kv.sequence(depth + room) for _ in range(b)]
    e.eval_batch([(rng.integers(3, e.config.n_vocab, depth), s) for s in seqs])

    def step() -> None:
        e.eval_batch([(rng.integers(3, e.config.n_vocab, 1), s) for s in seqs], ids=[True] * b)

    for _ in range(4):  # eager, captured, replayed
        step()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    for _ in range(repeat):
        step()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()


def parse(path: str, repeat: int) -> str:
    """ncu's --csv log -> a table of kernel names by total us a step."""
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own ==PROF== lines are not CSV
    tot, calls = defaultdict(float), defaultdict(int)
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        us = v / 1000 if unit.startswith("n") else v if unit.startswith("u") else v * 1000
        name = row["Kernel Name"].split("(")[0]
        tot[name] += us / repeat
        calls[name] += 1
    all_us = sum(tot.values())
    out = [f"{sum(calls.values()) // repeat} kernels a step, {all_us:.1f} us a step in all (each timed alone)", "",
           "| kernel | calls a step | us a step | us a call | share |", "|---|---|---|---|---|"]
    for name, us in sorted(tot.items(), key=lambda kv: -kv[1]):
        n = calls[name] / repeat
        out.append(f"| {name} | {n:g} | {us:.1f} | {us / n:.2f} | {100 * us / all_us:.1f}% |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("-b", "--batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1, help="steps profiled (and divided by, with --parse)")
    ap.add_argument("--parse", help="an ncu --csv log of this script: print its kernels' times")
    a = ap.parse_args()
    if a.parse:
        print(parse(a.parse, a.repeat))
    elif a.model:
        run(a.model, a.batch, a.depth, a.repeat)
    else:
        ap.error("give MODEL, or --parse CSV")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
