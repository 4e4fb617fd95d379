#!/usr/bin/env python3
"""Where a GPU decode step of B sequences spends its GPU time, op by op: Engine.eval_batch over paged caches of one
pool (one token each, as `hybrid serve -np N` steps), run eagerly with CUDA events around every GpuBackend call, GPU
us a step per call and weight (the outermost calls; what they call inside is in their time), next to the same
step replayed as a CUDA graph (host wall time, the server's case).

    python3 scripts/gpu_step_ops.py MODEL [-b 1,8] [--depth 256] [--steps 10] [--knockout]

Events add a little GPU idle time between ops, so the eager sum is a bound on the graph's GPU time, not its equal.
--knockout measures the graph itself instead: its replay's GPU time (events around the graph's launch) against the
step's host wall time, then the step captured again with each kind of op replaced by the outputs it gave in an
eager step (no launch): the wall time it saves is that op's share of the graph (a knocked-out norm leaves no 8-bit
copy, so the products after it quantize for themselves: its share is understated by one quantization)."""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import numpy as np

SKIP = {"decode_step", "to_host", "from_host", "upload", "alloc_like", "free_bytes", "limit_memory", "graph_report",
        "host_call", "report_routing", "captures_products", "new_kv_layer"}


def _kind(args) -> str:
    """The weights an op multiplies, layer numbers dropped (blk.3.attn_q.weight -> attn_q)."""
    names = []
    for a in args[:1]:
        for w in a if isinstance(a, (list, tuple)) else [a]:
            name = getattr(w, "name", None)
            if isinstance(name, str):
                names.append(re.sub(r"^blk\.\d+\.|\.weight$", "", name))
    return "+".join(names)


class OpTimer:
    """Wraps a backend's public methods: CUDA events around each outermost call on the current stream."""

    def __init__(self, backend, cupy):
        self.cp, self.depth, self.pending, self.names = cupy, 0, [], []
        for name in dir(backend):
            fn = getattr(backend, name)
            if name.startswith("_") or name in SKIP or not callable(fn) or isinstance(fn, type):
                continue
            setattr(backend, name, self._wrap(name, fn))
            self.names.append(name)
        self.backend = backend

    def close(self) -> None:
        """The backend's own methods back."""
        for name in self.names:
            delattr(self.backend, name)

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            if self.depth:
                return fn(*args, **kw)
            a, b = self.cp.cuda.Event(), self.cp.cuda.Event()
            a.record()
            self.depth += 1
            try:
                return fn(*args, **kw)
            finally:
                self.depth -= 1
                b.record()
                self.pending.append((f"{name} {_kind(args)}".strip(), a, b))
        return timed

    def collect(self) -> dict[str, list[float]]:
        """us and calls per op since the last collect (synchronizes)."""
        out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for key, a, b in self.pending:
            b.synchronize()
            out[key][0] += 1000 * self.cp.cuda.get_elapsed_time(a, b)
            out[key][1] += 1
        self.pending = []
        return out


KNOCKOUT = ("matmuls", "matmul", "attend_seqs", "attention", "rms_norm", "add_rms_norm", "fused_qk_norm_rope", "rope",
            "glu", "kv_store")


class Recorded:
    """Replaces backend methods by the outputs they returned in one recorded step, in call order (no launches)."""

    def __init__(self, backend, names):
        self.backend, self.names, self.outputs, self.record, self.i = backend, names, [], True, 0
        for name in names:
            setattr(backend, name, self._wrap(getattr(backend, name)))

    def _wrap(self, fn):
        def call(*args, **kw):
            if self.record:
                out = fn(*args, **kw)
                self.outputs.append(out)
                return out
            out = self.outputs[self.i % len(self.outputs)]
            self.i += 1
            return out
        return call

    def close(self) -> None:
        for name in self.names:
            delattr(self.backend, name)


def replay_gpu_ms(gpu, cupy, n: int = 20) -> float:
    """GPU ms of a replay of the decode graph used last (events around its launches on the runner's stream)."""
    runner = gpu._graphs
    entry = next(reversed(runner._entries.values()))
    st = runner.stream
    a, b = cupy.cuda.Event(), cupy.cuda.Event()
    a.record(st)
    for _ in range(n):
        entry.graph.launch(st)
    b.record(st)
    b.synchronize()
    return cupy.cuda.get_elapsed_time(a, b) / n


def knockout(e, gpu, cupy, sizes, depth: int, steps: int, rng) -> None:
    from gpu_batch_step import decode_batch, step_ms  # noqa: PLC0415

    keep = []  # the runners replaced (their pools hold the recorded outputs)
    for b in sizes:
        rows = {}
        for names in [()] + [(k,) for k in KNOCKOUT if hasattr(gpu, k)]:
            keep.append(gpu._graphs)
            gpu._graphs = None  # a new runner: the variant's own capture
            _, step = decode_batch(e, b, depth, 3 * steps + 64, rng)
            rec = Recorded(gpu, names)
            gpu.use_graphs = False
            step()  # eager: records the ops' outputs
            gpu.use_graphs = True
            rec.record = False
            if names and not rec.outputs:
                rec.close()
                continue
            wall = step_ms(step, steps)
            gpu_ms = replay_gpu_ms(gpu, cupy)
            rec.close()
            rows[names[0] if names else "(none)"] = (wall, gpu_ms, len(rec.outputs))
        base = rows["(none)"]
        print(f"\nB={b}: graph replay {base[1]:.3f} ms of GPU time, step {base[0]:.3f} ms host wall "
              f"(host beyond the GPU: {base[0] - base[1]:.3f} ms)")
        print("| op knocked out | calls a step | step wall ms | GPU ms a replay | the op's share, ms GPU |")
        print("|---|---|---|---|---|")
        for k, (wall, g, calls) in rows.items():
            print(f"| {k} | {calls} | {wall:.3f} | {g:.3f} | {base[1] - g:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-b", "--batch", default="1,8")
    ap.add_argument("--depth", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--knockout", action="store_true", help="each kind of op's share of the graph (see above)")
    a = ap.parse_args()
    import cupy  # noqa: PLC0415

    from gpu_batch_step import decode_batch, step_ms  # noqa: PLC0415 - scripts/ is on the path of a script run
    from hybrid.engine import Engine, EngineParams  # noqa: PLC0415

    e = Engine.load(a.model, EngineParams(n_ctx=8192, n_gpu_layers="all"))
    gpu = next(be for be in e.backends if be.name == "gpu")
    rng = np.random.default_rng(0)
    sizes = [int(x) for x in a.batch.split(",")]
    if a.knockout:
        knockout(e, gpu, cupy, sizes, a.depth, a.steps, rng)
        return
    tables = {}
    for b in sizes:
        seqs, step = decode_batch(e, b, a.depth, a.steps + 64, rng)
        graph_ms = step_ms(step, a.steps)
        for s in seqs:
            s.n_past = a.depth
        gpu.use_graphs = False
        timer = OpTimer(gpu, cupy)
        step()
        timer.collect()  # the first eager step's compiles and allocations left out
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        eager_ms = 1000 * (time.perf_counter() - t0) / a.steps
        ops = timer.collect()
        timer.close()
        gpu.use_graphs = True
        tables[b] = {k: (us / a.steps, n // a.steps) for k, (us, n) in ops.items()}
        total = sum(us for us, _ in tables[b].values())
        print(f"B={b}: graph step {graph_ms:.2f} ms (host wall); eager step {eager_ms:.2f} ms, its ops' GPU time "
              f"{total / 1000:.2f} ms", flush=True)
    keys = sorted({k for t in tables.values() for k in t}, key=lambda k: -max(t.get(k, (0, 0))[0] for t in
                                                                              tables.values()))
    print("\n| op | " + " | ".join(f"B={b} us a step (calls)" for b in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    for k in keys:
        cells = [f"{tables[b][k][0]:.0f} ({tables[b][k][1]})" if k in tables[b] else "" for b in sizes]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
