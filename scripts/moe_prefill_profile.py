#!/usr/bin/env python3
"""Where the time of an MoE layer's prefill goes on the GPU (kernels_gpu.moe.moe_ffn on one layer of a model).

    python3 scripts/moe_prefill_profile.py MODEL.gguf [--layer 0] [-n 512] [--reps 10] [--real] [--json OUT.json]

Uploads one layer's router and expert tensors, then times moe_ffn on n random rows (--real: the layer's own input
in a prefill of n random tokens, so routed as the model routes): the whole call (median wall time with a device
synchronization, what a prefill layer costs) next to the dequantize + cuBLAS path (moe.prefill) on the same input,
and each part of moe_ffn timed alone with a synchronization before and after (router matmul, routing, the grouping,
the gate+up GEMM with the GLU, the down GEMM, the combine). Parts timed alone add up to more than the whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import cupy

    from gguf_io import ModelConfig, open_gguf
    from hybrid.model.weights import load_weights
    from kernels_gpu import moe

    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("-n", type=int, default=512, help="tokens of the batch")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--real", action="store_true", help="the layer's real input in a prefill of random tokens "
                    "(every layer on the GPU), not random rows")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    names = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    if args.real:  # the layer's input in a prefill of random tokens with every layer on the GPU
        from hybrid.backends.gpu import GpuBackend
        from hybrid.engine import Engine, EngineParams

        eng = Engine.load(args.model, EngineParams(n_ctx=2 * args.n, n_batch=args.n, n_ubatch=args.n,
                                                   n_gpu_layers="all"))
        cfg, seen = eng.config, []
        orig_fused = GpuBackend.fused_moe

        def record(self, spec, cfg_, lw_, h_, residual=None):
            seen.append(cupy.array(h_, dtype=cupy.float32))
            return orig_fused(self, spec, cfg_, lw_, h_, residual)

        GpuBackend.fused_moe = record
        try:
            eng.eval(np.random.default_rng(0).integers(0, cfg.n_vocab, args.n), eng.new_cache())
        finally:
            GpuBackend.fused_moe = orig_fused
        h = seen[args.layer]
        lw = eng.weights.layers[args.layer]
        dev = {n: (lw[n].raw, lw[n].type_name) for n in names}
    else:
        with open_gguf(args.model) as f:
            cfg = ModelConfig.from_gguf(f)
            lw = load_weights(f, cfg).layers[args.layer]
            dev = {n: (cupy.asarray(np.ascontiguousarray(lw[n].raw)), lw[n].type_name) for n in names}
        h = cupy.asarray(np.random.default_rng(0).standard_normal((args.n, cfg.n_embd)).astype(np.float32))

    router = moe.Router(cfg.n_expert_used, True)
    experts = tuple(dev[n] for n in names[1:])
    shapes = tuple(moe._expert_dims(*w)[1:3] for w in experts)

    def call():
        return moe.moe_ffn(h, dev[names[0]], *experts, router, "silu")

    def call_dequant():  # the dequantize + cuBLAS path the tensor-core kernels replace, for the ratio
        ids_, wts_ = moe.route_with(moe.matmul(*dev[names[0]], h), router)
        return moe.prefill(h, ids_, wts_, shapes, tuple(moe.resident_experts(*w) for w in experts), "silu")

    def timed(fn) -> float:
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        return time.perf_counter() - t0

    wholes = {}
    for label, fn in (("tensor-core path (moe_ffn)", call), ("dequantize + cuBLAS path", call_dequant)):
        for _ in range(2):
            fn()
        wholes[label] = statistics.median(timed(fn) for _ in range(args.reps))
    agree = float(cupy.abs(call() - call_dequant()).max() / cupy.abs(call_dequant()).max())

    parts: dict[str, list[float]] = defaultdict(list)
    wrapped = {"matmul": "router matmul", "route_with": "route", "group": "grouping", "combine": "combine"}
    saved = {name: getattr(moe, name) for name in wrapped}
    saved_kernel = moe._mma_kernel

    def sync_timed(orig, label):
        def w(*a, **k):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            r = orig(*a, **k)
            cupy.cuda.Device().synchronize()
            parts[label].append(time.perf_counter() - t0)
            return r

        return w

    def mma_kernel(type_name, glu_):
        fn, smem = saved_kernel(type_name, glu_)
        return sync_timed(fn, "gate+up GEMM, GLU" if glu_ else "down GEMM"), smem

    for name, label in wrapped.items():
        setattr(moe, name, sync_timed(saved[name], label))
    moe._mma_kernel = mma_kernel
    try:
        runs = []
        for _ in range(args.reps):
            parts.clear()
            call()
            runs.append({k: sum(v) for k, v in parts.items()} | {k + " calls": len(v) for k, v in parts.items()})
    finally:
        for name in wrapped:
            setattr(moe, name, saved[name])
        moe._mma_kernel = saved_kernel
    keys = [k for k in runs[0] if not k.endswith(" calls")]
    rows = {k: statistics.median(r[k] for r in runs) for k in keys}
    ids, _ = moe.route_with(moe.matmul(*dev[names[0]], h), router)
    counts = np.bincount(cupy.asnumpy(ids).reshape(-1), minlength=cfg.n_expert)
    tiles = int((-(-counts // moe.MM_BM)).sum())
    print(f"=== MoE prefill profile: {args.model.name} layer {args.layer} ({'real' if args.real else 'random'} "
          f"input; tokens an expert: max {counts.max()}, median {int(np.median(counts))}, unused "
          f"{int((counts == 0).sum())}), {args.n} tokens, {cfg.n_expert} experts, {cfg.n_expert_used} used; "
          f"{tiles} tiles of <= {moe.MM_BM} rows")
    for label, whole in wholes.items():
        print(f"whole, {label}: {1e3 * whole:.3f} ms ({args.n / whole:.0f} tokens/s for this layer alone; x "
              f"{cfg.n_layer} layers: {args.n / whole / cfg.n_layer:.0f} t/s)")
    first, second = wholes.values()
    print(f"tensor-core / dequantize speed: {second / first:.2f}x; outputs differ by {agree:.2e} of the largest")
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {k:18s} {1e3 * v:8.3f} ms  ({runs[0][k + ' calls']} calls)")
    if args.json:
        args.json.write_text(json.dumps({"whole_ms": {k: 1e3 * v for k, v in wholes.items()},
                                         "parts_ms": {k: 1e3 * v for k, v in rows.items()}, "tiles": tiles,
                                         "max_rel_diff": agree}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
