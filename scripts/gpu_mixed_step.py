#!/usr/bin/env python3
"""Where a mixed step goes on the GPU: a server step that carries a prompt chunk beside running streams
(Engine.eval_batch of N one-token sequences and one chunk of C tokens at depth D, paged caches of one pool), its ms
against the same streams' decode step alone, and a profile of one mixed step (the host functions that take the most
time; the time the host waits for the GPU shows as the device-to-host copy of the logits).

    python3 scripts/gpu_mixed_step.py MODEL [--streams 4] [--chunks 12,28,60] [--depths 512,4000,7900] [--steps 10]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--chunks", default="12,28,60")
    ap.add_argument("--depths", default="512,4000,7900")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("-ngl", default="all")
    ap.add_argument("--profile-rows", type=int, default=25)
    a = ap.parse_args()

    from hybrid.engine import Engine, EngineParams  # noqa: PLC0415
    from hybrid.kv.paged import PagedKV  # noqa: PLC0415

    e = Engine.load(a.model, EngineParams(n_ctx=16384, n_gpu_layers=a.ngl))
    rng = np.random.default_rng(0)
    depths = [int(x) for x in a.depths.split(",")]
    chunks = [int(x) for x in a.chunks.split(",")]
    cap = max(depths) + max(chunks) + 64
    kv = PagedKV(e.config, e.backends, (a.streams * 256 + cap) // 64 + 8, 64, e.params.type_k, e.params.type_v)
    streams = [kv.sequence(256) for _ in range(a.streams)]
    e.eval_batch([(rng.integers(3, e.config.n_vocab, 64), s) for s in streams])
    long = kv.sequence(cap)
    toks = rng.integers(3, e.config.n_vocab, cap)
    t0 = time.perf_counter()
    e.eval(toks[: max(depths)], long)
    t_pp = time.perf_counter() - t0
    print(f"unchunked prefill of {max(depths)} tokens: {t_pp:.2f} s, {max(depths) / t_pp:.0f} tokens/s")

    def step(d: int, c: int | None):
        long.n_past = d
        for s in streams:
            s.n_past = 64
        batch = [(rng.integers(3, e.config.n_vocab, 1), s) for s in streams]
        if c:
            batch.append((toks[d: d + c], long))
        e.eval_batch(batch)

    for _ in range(3):
        step(0, None)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step(0, None)
    solo = 1000 * (time.perf_counter() - t0) / a.steps
    print(f"decode step of {a.streams} streams alone: {solo:.2f} ms")
    import hybrid.engine.engine as ke  # noqa: PLC0415
    import kernels_gpu.matmul as km  # noqa: PLC0415

    # (name, mixed-graph rows, tensor-core rows): the step eager with every chunk product on dequantize + GEMM (the
    # design before mixed graphs), as a CUDA graph with GEMM, and as a graph with the tensor-core kernel (default)
    configs = [("eager, GEMM", 0, 0), ("graph, GEMM", ke.MIXED_GRAPH_MAX_ROWS, 0),
               ("graph, mmq", ke.MIXED_GRAPH_MAX_ROWS, km.MMQ_MAX_TOKENS)]
    print("| depth | chunk | " + " | ".join(f"{n} ms" for n, _, _ in configs) + " | default / decode step | "
          "chunk tokens/s |")
    print("|---" * (len(configs) + 4) + "|")
    for d in depths:
        for c in chunks:
            row = []
            for _, graph_rows, mmq_rows in configs:
                ke.MIXED_GRAPH_MAX_ROWS, km.MMQ_MAX_TOKENS = graph_rows, mmq_rows
                for _ in range(2):  # eager, then captured (the graph's first replay comes next)
                    step(d, c)
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    step(d, c)
                row.append(1000 * (time.perf_counter() - t0) / a.steps)
            ms = row[-1]
            print(f"| {d} | {c} | " + " | ".join(f"{x:.1f}" for x in row) + f" | {ms / solo:.1f} | "
                  f"{c * 1000 / ms:.0f} |", flush=True)
    gpu = next((be for be in e.backends if hasattr(be, "graph_report")), None)
    if gpu is not None:
        print(gpu.graph_report())
    matmul_times(e, rng)
    d, c = depths[-1], chunks[-1]
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        step(d, c)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.profile_rows)
    print(f"profile of 3 mixed steps (depth {d}, chunk {c}), by own time:")
    print(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(a.profile_rows)
    print(s.getvalue())


def matmul_times(e, rng) -> None:
    """GPU us of each matrix of the first layer (and the first Q6_K ffn_down) at 1-128 tokens, as matmul runs it by
    default (auto) and on the dequantize + GEMM path."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError:
        return
    from kernels_gpu.matmul import gpu_kernel, matmul  # noqa: PLC0415

    if not isinstance(e.weights.layers[0]["attn_q"].raw, cupy.ndarray):
        return
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    picks = [(0, n) for n in names]
    q6 = [il for il, lw in enumerate(e.weights.layers) if lw["ffn_down"].type_name == "Q6_K"]
    if q6:
        picks.append((q6[0], "ffn_down"))
    sizes = [(1, "auto"), (8, "auto"), (16, "gemm"), (16, "auto"), (32, "gemm"), (32, "auto"), (64, "gemm"),
             (64, "auto"), (128, "auto")]
    print("| matrix | " + " | ".join(f"{n} tok {p} us" for n, p in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    for il, name in picks:
        w = e.weights.layers[il][name]
        k = gpu_kernel(w.type_name)
        row = []
        for n, path in sizes:
            x = cupy.asarray(rng.standard_normal((n, w.raw.shape[1] // k.type_size * k.block_size), dtype=np.float32))
            matmul(w.raw, w.type_name, x, path=path)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(20):
                matmul(w.raw, w.type_name, x, path=path)
            end.record()
            end.synchronize()
            row.append(f"{1000 * cupy.cuda.get_elapsed_time(start, end) / 20:.1f}")
        print(f"| {il}.{name} {w.type_name} {tuple(w.shape)} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
