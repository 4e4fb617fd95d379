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
    kv = PagedKV(e.config, e.backends, (a.streams * 256 + 2 * cap) // 64 + 16, 64, e.params.type_k, e.params.type_v)
    streams = [kv.sequence(cap) for _ in range(a.streams)]  # one table width: a server's slots (Engine._one_pool)
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
    import kernels_gpu.attention as ka  # noqa: PLC0415
    import kernels_gpu.matmul as km  # noqa: PLC0415

    # (name, mixed-graph rows, tensor-core matmul rows, tensor-core prefill attention): the step eager with the chunk's
    # products on dequantize + GEMM and the fp32 tiled attention (the design before), with the tensor-core products,
    # with the tensor-core attention too, and through decode_step as a graph (the default, where every product captures)
    mmq_rows = km.MMQ_MAX_TOKENS
    defaults = (ke.MIXED_GRAPH_MAX_ROWS, mmq_rows)
    configs = [("eager, GEMM, fp32 attention", 0, 0, False), ("eager, mmq, fp32 attention", 0, mmq_rows, False),
               ("eager, mmq, mma attention", 0, mmq_rows, True),
               ("graph, mmq, mma attention", max(64, defaults[0]), mmq_rows, True)]
    print("| depth | chunk | " + " | ".join(f"{c[0]} ms" for c in configs) + " | default / decode step | "
          "chunk tokens/s |")
    print("|---" * (len(configs) + 4) + "|")
    for d in depths:
        for c in chunks:
            row = []
            for _, graph_rows, mmq_rows, mma in configs:
                ke.MIXED_GRAPH_MAX_ROWS, km.MMQ_MAX_TOKENS, ka.PREFILL_MMA = graph_rows, mmq_rows, mma
                for _ in range(3):  # eager, eager in the graph runner, captured (Engine.MIXED_SEEN); replays next
                    step(d, c)
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    step(d, c)
                row.append(1000 * (time.perf_counter() - t0) / a.steps)
            ms = row[3]  # the default configuration
            print(f"| {d} | {c} | " + " | ".join(f"{x:.1f}" for x in row) + f" | {ms / solo:.1f} | "
                  f"{c * 1000 / ms:.0f} |", flush=True)
    ke.MIXED_GRAPH_MAX_ROWS, km.MMQ_MAX_TOKENS = defaults
    for mma in (False, True):  # the unchunked prompt with each attention kernel
        ka.PREFILL_MMA = mma
        other = kv.sequence(cap)
        e.eval(toks[:256], other)  # warm
        other.release()
        t0 = time.perf_counter()
        e.eval(toks[: max(depths)], other)
        t_pp = time.perf_counter() - t0
        other.release()
        print(f"unchunked prefill of {max(depths)} tokens, {'tensor-core' if mma else 'fp32'} attention: "
              f"{t_pp:.2f} s, {max(depths) / t_pp:.0f} tokens/s")
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
    default (auto) and on the dequantize + GEMM path: 20 calls replayed as one CUDA graph (gpu_check.time_graph;
    where the capture fails, plain launches timed by events, marked)."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError:
        return
    from gpu_check import time_graph  # noqa: PLC0415 - scripts/ is on the path of a script run
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
            sec, how = time_graph([lambda: matmul(w.raw, w.type_name, x, path=path)] * 20)
            row.append(f"{sec * 1e6:.1f}" + ("" if how == "graph" else f" ({how}: launches, not the GPU alone)"))
        print(f"| {il}.{name} {w.type_name} {tuple(w.shape)} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
