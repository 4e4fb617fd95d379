#!/usr/bin/env python3
"""Where the time of one decode token goes on the CPU (every layer on the CPU).

    python3 scripts/cpu_decode_profile.py [MODEL.gguf] [-t THREADS] [--depth 32] [-n 32] [--ab 3] [--json OUT.json]

Pins the threads as `hybrid run` does, fills the cache to --depth, then times -n decode steps: the wall time per
token with the fused layers (CpuBackend's default) and op by op (fused off), alternating --ab times, then op by op
with each CpuBackend op timed: the wall time and each op (the calls wrapped with a timer), the matmuls split by
weight type and shape with the bytes they read and GB/s. The demo model is the default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPS = ("matmul", "matmuls", "get_rows", "rms_norm", "add_rms_norm", "rms_norm_heads", "rope", "scale", "glu", "kv_store", "attention")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--ab", type=int, default=3, help="rounds of fused vs op by op, untimed, alternating")
    a = ap.parse_args()

    from hybrid.backends.cpu import CpuBackend
    from hybrid.engine import Engine, EngineParams
    from hybrid.model.files import demo_model_path
    from hybrid.system.threads import setup_threads

    threads = setup_threads(a.threads)
    eng = Engine.load(a.model or demo_model_path(), EngineParams(n_ctx=max(256, a.depth + a.n + 8)))
    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    enabled = [False]

    def wrap(name, fn):
        def timed(self, *args, **kw):
            if not enabled[0]:
                return fn(self, *args, **kw)
            t0 = time.perf_counter()
            out = fn(self, *args, **kw)
            dt = time.perf_counter() - t0
            key = name
            if name == "matmul":
                w = args[0]
                key = f"matmul {w.type_name} {w.shape[0]}x{w.shape[1]}"
                nbytes[key] += w.raw.nbytes
            elif name == "matmuls":  # several weights times one x (q/k/v, gate/up)
                key = "matmuls " + " + ".join(f"{w.type_name} {w.shape[0]}x{w.shape[1]}" for w in args[0])
                nbytes[key] += sum(w.raw.nbytes for w in args[0])
            times[key] += dt
            calls[key] += 1
            return out
        return timed

    for op in OPS:
        setattr(CpuBackend, op, wrap(op, getattr(CpuBackend, op)))

    def untimed_ms(fused: bool) -> float:  # the wall time per token, no op timed; fused: CpuBackend's default path
        eng.cpu.fused = fused
        cache = eng.new_cache()
        eng.eval(list(range(3, 3 + a.depth)), cache)
        eng.eval([5], cache)
        t0 = time.perf_counter()
        for _ in range(a.n):
            eng.eval([5], cache)
        return 1000 * (time.perf_counter() - t0) / a.n

    walls = {True: [], False: []}
    for _ in range(a.ab):  # fused and op by op alternating: this machine drifts between runs
        for fused in (False, True):
            walls[fused].append(untimed_ms(fused))
    fused_wall, plain_wall = statistics.median(walls[True]), statistics.median(walls[False])
    eng.cpu.fused = False  # the breakdown below times the ops one by one
    cache = eng.new_cache()
    eng.eval(list(range(3, 3 + a.depth)), cache)
    eng.eval([5], cache)  # compile/warm
    wall = []
    enabled[0] = True
    for _ in range(a.n):
        t0 = time.perf_counter()
        eng.eval([5], cache)
        wall.append(time.perf_counter() - t0)
    enabled[0] = False
    n = a.n
    wall_ms = 1000 * sum(wall) / n
    rows = sorted(times, key=times.get, reverse=True)
    total_w = sum(nbytes.values()) / n
    print(f"{threads.describe()}; model {Path(eng.gguf.path).name if hasattr(eng.gguf, 'path') else ''}")
    print(f"fused layers (the default): {fused_wall:.2f} ms a token ({1000 / fused_wall:.1f} t/s); op by op "
          f"{plain_wall:.2f} ms: {plain_wall / fused_wall:.3f}x (medians of {a.ab}, alternating)")
    print("op by op, each op timed:")
    print(f"token: {wall_ms:.2f} ms wall ({1000 / wall_ms:.1f} t/s), depth {a.depth}; weights read "
          f"{total_w / 1e9:.3f} GB a token = {total_w / (wall_ms / 1000) / 1e9:.1f} GB/s over the whole token")
    print(f"{'op':40s} {'calls':>6s} {'us/call':>9s} {'ms/token':>9s} {'GB/s':>7s}")
    out_rows = []
    for k in rows:
        ms = 1000 * times[k] / n
        gbs = nbytes[k] / times[k] / 1e9 if nbytes.get(k) else None
        print(f"{k:40s} {calls[k] // n:6d} {1e6 * times[k] / calls[k]:9.1f} {ms:9.3f} "
              f"{'' if gbs is None else f'{gbs:7.1f}'}")
        out_rows.append({"op": k, "calls": calls[k] // n, "ms_per_token": ms, "gb_per_s": gbs})
    other = wall_ms - 1000 * sum(times.values()) / n
    print(f"{'(between ops: Python, residual adds)':40s} {'':6s} {'':9s} {other:9.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"threads": threads.n_threads, "fused_ms_per_token": fused_wall,
                                            "op_by_op_ms_per_token": plain_wall, "wall_ms_per_token": wall_ms,
                                            "ops": out_rows, "between_ops_ms": other}, indent=1))


if __name__ == "__main__":
    main()
