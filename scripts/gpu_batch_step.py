#!/usr/bin/env python3
"""Where a GPU decode step of B sequences goes: ms a step of Engine.eval_batch over paged caches of one pool (the
decode graphs of `hybrid serve -np N`) at each B, how its graphs ran, and the matvec of one layer's matrices at B
tokens (the float-activation kernels of 2-8 tokens against the 8-bit one-token kernel).

    python3 scripts/gpu_batch_step.py MODEL [-b 1,2,4,8] [--depth 64] [--steps 30]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-b", "--batch", default="1,2,4,8")
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    import cupy  # noqa: PLC0415

    from hybrid.engine import Engine, EngineParams  # noqa: PLC0415
    from hybrid.kv.paged import PagedKV  # noqa: PLC0415
    from kernels_gpu.matmul import gpu_kernel, matmul  # noqa: PLC0415

    e = Engine.load(a.model, EngineParams(n_ctx=8192, n_gpu_layers="all"))
    gpu = next(be for be in e.backends if be.name == "gpu")
    rng = np.random.default_rng(0)
    for b in (int(x) for x in a.batch.split(",")):
        kv = PagedKV(e.config, e.backends, 8 * 64, 64, e.params.type_k, e.params.type_v)
        seqs = [kv.sequence(1024) for _ in range(b)]
        e.eval_batch([(rng.integers(3, e.config.n_vocab, a.depth), s) for s in seqs])
        for _ in range(3):  # eager, captured, replayed
            e.eval_batch([(rng.integers(3, e.config.n_vocab, 1), s) for s in seqs])
        t0 = time.perf_counter()
        for _ in range(a.steps):
            e.eval_batch([(rng.integers(3, e.config.n_vocab, 1), s) for s in seqs])
        ms = 1000 * (time.perf_counter() - t0) / a.steps
        print(f"B={b}: {ms:.2f} ms a step, {b * 1000 / ms:.1f} tokens/s")
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
