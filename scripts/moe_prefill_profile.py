#!/usr/bin/env python3
"""Where the time of an MoE layer's prefill goes on the GPU (kernels_gpu.moe.moe_ffn on one layer of a model).

    python3 scripts/moe_prefill_profile.py MODEL.gguf [--layer 0] [-n 512] [--reps 10] [--real] [--json OUT.json]

Uploads one layer's router and expert tensors, then times moe_ffn on n random rows (--real: the layer's own input
in a prefill of n random tokens, so routed as the model routes): the whole call (median
wall time with a device synchronization, what a prefill layer costs), and each part timed alone with a
synchronization before and after (router matmul, routing, the host grouping with its copy of the ids, the gather,
each projection's dequantization and GEMMs, the GLU, the combine). Parts timed alone add up to more than the whole
(no overlap of host and device work between them).
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

        def record(self, spec, cfg_, lw_, h_):
            seen.append(cupy.array(h_, dtype=cupy.float32))
            return orig_fused(self, spec, cfg_, lw_, h_)

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

    def call():
        return moe.moe_ffn(h, *(dev[n] for n in names), moe.Router(cfg.n_expert_used, True), "silu")

    def timed(fn) -> float:
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        return time.perf_counter() - t0

    for _ in range(2):
        call()
    whole = statistics.median(timed(call) for _ in range(args.reps))

    parts: dict[str, list[float]] = defaultdict(list)
    wrapped = {"matmul": "router matmul", "route": "route", "_groups": "host grouping", "_gather_f16": "gather",
               "glu": "glu", "combine": "combine"}
    saved = {name: getattr(moe, name) for name in wrapped}

    def wrap(name, label):
        orig = saved[name]

        def w(*a, **k):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            r = orig(*a, **k)
            cupy.cuda.Device().synchronize()
            parts[label].append(time.perf_counter() - t0)
            return r

        return w

    orig_resident = moe.resident_experts

    def resident(raw, type_name):
        inner = orig_resident(raw, type_name)

        def dequant(e0, e1, out):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            inner(e0, e1, out)
            cupy.cuda.Device().synchronize()
            parts["dequantize"].append(time.perf_counter() - t0)

        return dequant

    orig_gemm = moe._BatchedGemm.__call__

    def gemm(self, *a):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        orig_gemm(self, *a)
        cupy.cuda.Device().synchronize()
        parts["GEMMs"].append(time.perf_counter() - t0)

    for name, label in wrapped.items():
        setattr(moe, name, wrap(name, label))
    moe.resident_experts = resident
    moe._BatchedGemm.__call__ = gemm
    try:
        runs = []
        for _ in range(args.reps):
            parts.clear()
            call()
            runs.append({k: sum(v) for k, v in parts.items()} | {k + " calls": len(v) for k, v in parts.items()})
    finally:
        for name in wrapped:
            setattr(moe, name, saved[name])
        moe.resident_experts = orig_resident
        moe._BatchedGemm.__call__ = orig_gemm
    keys = [k for k in runs[0] if not k.endswith(" calls")]
    rows = {k: statistics.median(r[k] for r in runs) for k in keys}
    ids, _ = moe.route(moe.matmul(dev[names[0]][0], dev[names[0]][1], h), cfg.n_expert_used, True)
    grp, src, _ = moe._groups(cupy.asnumpy(ids), moe.max_run(((cfg.n_ff_exp, cfg.n_embd),) * 3))
    counts = np.bincount(cupy.asnumpy(ids).reshape(-1), minlength=cfg.n_expert)
    print(f"=== MoE prefill profile: {args.model.name} layer {args.layer} ({'real' if args.real else 'random'} "
          f"input; tokens an expert: max {counts.max()}, median {int(np.median(counts))}, unused "
          f"{int((counts == 0).sum())}), {args.n} tokens, "
          f"{cfg.n_expert} experts, {cfg.n_expert_used} used; {len(grp)} runs, {src.shape[0]} rows for "
          f"{args.n * cfg.n_expert_used} pairs")
    print(f"whole moe_ffn: {1e3 * whole:.3f} ms ({args.n / whole:.0f} tokens/s for this layer alone; x "
          f"{cfg.n_layer} layers: {args.n / whole / cfg.n_layer:.0f} t/s)")
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {k:16s} {1e3 * v:8.3f} ms  ({runs[0][k + ' calls']} calls)")
    if args.json:
        args.json.write_text(json.dumps({"whole_ms": 1e3 * whole, "parts_ms": {k: 1e3 * v for k, v in rows.items()},
                                         "runs": len(grp), "rows": int(src.shape[0])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
