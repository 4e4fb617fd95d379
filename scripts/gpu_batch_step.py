#!/usr/bin/env python3
"""Where a GPU decode step of B sequences goes: ms a step of Engine.eval_batch over paged caches of one pool (the
decode graphs of `hybrid serve -np N`) at each B, with the logits and with the greedy ids alone crossing back
(eval_batch's ids), how its graphs ran, and the matvec of one layer's matrices at B
tokens (the float-activation kernels of 2-8 tokens against the 8-bit one-token kernel).

    python3 scripts/gpu_batch_step.py MODEL [-b 1,2,4,8] [--depth 64] [--steps 30] [--multi 1,0]

--multi 1,0: each batch size with matmul_many's Q4_K weights in one tensor-core launch (kernels_gpu.matmul.MMQ_MULTI)
and then a launch each, the graphs captured again for each.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def decode_batch(e, b: int, depth: int, room: int, rng):
    """b paged sequences of one pool (a server's slots) with `depth` prompt tokens evaluated and room for `room` more,
    and a function that runs one decode step of all of them (a token each)."""
    from hybrid.kv.paged import PagedKV  # noqa: PLC0415

    kv = PagedKV(e.config, e.backends, b * (depth + room) // 64 + 8, 64, e.params.type_k, e.params.type_v)
    seqs = [kv.sequence(depth + room) for _ in range(b)]
    e.eval_batch([(rng.integers(3, e.config.n_vocab, depth), s) for s in seqs])

    def step(ids: bool = False) -> None:
        e.eval_batch([(rng.integers(3, e.config.n_vocab, 1), s) for s in seqs], ids=[ids] * b)

    return seqs, step


def step_ms(step, steps: int) -> float:
    """ms a call of step, over `steps` calls after three (eager, captured, replayed)."""
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return 1000 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-b", "--batch", default="1,2,4,8")
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--multi", default="", help="MMQ_MULTI values to measure in turn (1,0), default as it is")
    a = ap.parse_args()
    import cupy  # noqa: PLC0415

    import kernels_gpu.matmul as km  # noqa: PLC0415

    from hybrid.engine import Engine, EngineParams  # noqa: PLC0415
    from kernels_gpu.matmul import gpu_kernel, matmul  # noqa: PLC0415

    e = Engine.load(a.model, EngineParams(n_ctx=8192, n_gpu_layers="all"))
    gpu = next(be for be in e.backends if be.name == "gpu")
    rng = np.random.default_rng(0)
    multis = [bool(int(v)) for v in a.multi.split(",")] if a.multi else [km.MMQ_MULTI]
    for b in (int(x) for x in a.batch.split(",")):
        _, step = decode_batch(e, b, a.depth, 1024 - a.depth, rng)
        for multi in multis:
            km.MMQ_MULTI = multi
            gpu._graphs = None  # captured again with this setting
            ms = step_ms(step, a.steps)
            ms_ids = step_ms(lambda: step(ids=True), a.steps)
            tag = f" (MMQ_MULTI {int(multi)})" if a.multi else ""
            print(f"B={b}{tag}: {ms:.2f} ms a step, {b * 1000 / ms:.1f} tokens/s; {ms_ids:.2f} ms with the greedy "
                  f"ids alone crossing back ({b * 1000 / ms_ids:.1f} tokens/s)")
    print(gpu.graph_report())
    lw = e.weights.layers[0]
    for name in ("attn_q", "ffn_up", "ffn_down"):
        w = lw[name]
        for n in (1, 2, 4, 8):
            k = gpu_kernel(w.type_name)
            x = cupy.asarray(rng.standard_normal((n, w.raw.shape[1] // k.type_size * k.block_size), dtype=np.float32))
            matmul(w.raw, w.type_name, x)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(20):
                matmul(w.raw, w.type_name, x)
            end.record()
            end.synchronize()
            us = 1000 * cupy.cuda.get_elapsed_time(start, end) / 20
            print(f"{name} {w.type_name} {tuple(w.shape)} x {n} tokens: {us:.1f} us "
                  f"({w.raw.nbytes / us / 1e3:.0f} GB/s)")


if __name__ == "__main__":
    main()
