#!/usr/bin/env python3
"""Where the time of one decode token goes on the GPU (all layers offloaded).

    python3 scripts/decode_profile.py MODEL.gguf [--depth 64] [-ctk f16] [-ctv f16] [--json OUT.json]

Measures (1) the wall time of Engine.eval([tok]) per token (what `hybrid bench` tg sees), (2) the GPU time of
the captured token graph replayed alone (CUDA events), (3) each backend op of one token recorded eagerly and
re-timed per op kind as a CUDA graph over all of that kind's calls of the token (so weights stream from HBM as
in a real token, not from L2), with bytes moved and GB/s for the matmuls. The weight bytes over the measured
device copy rate give the bandwidth limit on tokens/s (MoE: the experts a token uses, n_expert_used of n_expert).
MoE layers (GpuBackend.fused_moe) are split into their parts: "moe router+route+q8" (a decode token's router
matvec, softmax and top-k and the q8 quantization of the experts' input in one launch), or where that does not
apply "moe router" (the router matmul) and "moe route" (softmax and top-k); "moe experts" (the gate/up and down id matvecs, and the q8 quantization of their inputs),
"moe glu" or "moe glu+q8" (the GLU with the q8 quantization of the down input) and "moe combine" (the weighted
sum).
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
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import time_events, time_graph  # noqa: E402

OPS = ("matmul", "matmuls", "rms_norm", "add_rms_norm", "rms_norm_heads", "rope", "fused_qk_norm_rope", "scale", "glu",
       "kv_store", "attention")
# kernels_gpu.moe's module-level functions its moe_ffn calls, wrapped as the backend's ops are
MOE_OPS = {"matmul": "moe router", "route_with": "moe route", "router_route": "moe router+route+q8",
           "id_matvec": "moe experts",
           "glu": "moe glu", "_glu_q8": "moe glu+q8", "combine": "moe combine"}


def copy_rate() -> float:
    import cupy

    a = cupy.ones(1 << 28, dtype=cupy.float32)
    b = cupy.empty_like(a)
    t = time_events(lambda: cupy.copyto(b, a), reps=10)
    return 2 * a.nbytes / t


def record_token(eng, gpu, cache, tok: int) -> list[tuple[tuple, object, int]]:
    """(kind key, replay closure, bytes read from weights) of every backend op of one eager decode token."""
    calls = []
    saved = {}
    for name in OPS:
        orig = getattr(gpu, name)
        saved[name] = orig

        def wrapper(*a, _orig=orig, _name=name, **k):
            if _name == "matmul":
                w = a[0]
                key, nbytes = (_name, w.type_name, tuple(w.shape)), int(w.raw.nbytes)
            elif _name == "matmuls":  # e.g. "matmuls Q4_K 4096+1024+1024x4096" (types joined by / when mixed)
                ws = a[0]
                types = "/".join(dict.fromkeys(w.type_name for w in ws))
                shape = "+".join(str(w.shape[0]) for w in ws) + f"x{ws[0].shape[1]}"
                key, nbytes = (_name, types, shape), sum(int(w.raw.nbytes) for w in ws)
            else:
                first = next((v for v in a if hasattr(v, "shape")), None)
                key, nbytes = (_name, tuple(first.shape) if first is not None else ()), 0
            calls.append((key, lambda: _orig(*a, **k), nbytes))
            return _orig(*a, **k)

        setattr(gpu, name, wrapper)
    from kernels_gpu import moe

    moe_saved = {name: getattr(moe, name) for name in MOE_OPS}
    for name, label in MOE_OPS.items():
        orig = moe_saved[name]

        def moe_wrapper(*a, _orig=orig, _name=name, _label=label, **k):
            nbytes = 0
            if _name == "id_matvec":  # a, k: (ws, type, x, ids, x_div): slots x matrices x one expert each
                ws, ids = a[0], a[3]
                nbytes = len(ws) * int(ids.shape[0]) * int(ws[0].nbytes // ws[0].shape[0])
                key = (_label, a[1], f"{len(ws)}x{int(ids.shape[0])} slots of {ws[0].shape[1]}x{ws[0].shape[2]}B")
            elif _name == "matmul":
                nbytes = int(a[0].nbytes)
                key = (_label, a[1], tuple(a[0].shape))
            else:
                first = next((v for v in a if hasattr(v, "shape")), None)
                key = (_label, tuple(first.shape) if first is not None else ())
            calls.append((key, lambda: _orig(*a, **k), nbytes))
            return _orig(*a, **k)

        setattr(moe, name, moe_wrapper)
    use = gpu.use_graphs
    gpu.use_graphs = False
    try:
        eng.eval([tok], cache)
    finally:
        gpu.use_graphs = use
        for name in OPS:
            delattr(gpu, name)  # back to the class's methods
        for name, orig in moe_saved.items():
            setattr(moe, name, orig)
    return calls


def main() -> int:
    import cupy

    from hybrid.engine import Engine, EngineParams

    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--depth", type=int, default=64, help="tokens in the cache before the profiled token")
    ap.add_argument("-ctk", default="f16")
    ap.add_argument("-ctv", default="f16")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    eng = Engine.load(args.model, EngineParams(n_ctx=1024, n_gpu_layers="all", type_k=args.ctk, type_v=args.ctv))
    gpu = eng.output_backend
    rng = np.random.default_rng(3)
    cache = eng.new_cache()
    eng.eval(rng.integers(0, eng.config.n_vocab, args.depth), cache)
    for _ in range(3):  # first run eager, second captured, third replayed
        eng.eval([int(rng.integers(0, eng.config.n_vocab))], cache)
    wall = []
    for _ in range(args.tokens):
        t0 = time.perf_counter()
        eng.eval([int(rng.integers(0, eng.config.n_vocab))], cache)
        wall.append(time.perf_counter() - t0)
    wall_s = statistics.median(wall)
    runner = gpu._graphs
    entry = next(reversed(runner._entries.values()))
    st = runner.stream
    gt = []
    for _ in range(20):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(st)
        entry.graph.launch(st)
        b.record(st)
        b.synchronize()
        gt.append(cupy.cuda.get_elapsed_time(a, b) / 1e3)
    graph_s = statistics.median(gt)

    fused_res = []  # MoE layers whose residual add ran inside the experts' weighted sum (moe_combine)
    orig_moe = gpu.fused_moe

    def counting_moe(*a, **k):
        out = orig_moe(*a, **k)
        fused_res.append(out is not None and (len(a) > 4 and a[4] is not None or k.get("residual") is not None))
        return out

    gpu.fused_moe = counting_moe
    try:
        calls = record_token(eng, gpu, cache, int(rng.integers(0, eng.config.n_vocab)))
    finally:
        del gpu.fused_moe
    groups: dict = defaultdict(list)
    for key, fn, nbytes in calls:
        groups[key].append((fn, nbytes))

    rows = []
    for key, items in groups.items():
        t, how = time_graph([fn for fn, _ in items], reps=5)
        nbytes = sum(b for _, b in items) / len(items)
        row = {"op": " ".join(map(str, key)), "calls": len(items), "us_per_call": 1e6 * t,
               "us_per_token": 1e6 * t * len(items), "GBps": nbytes / t / 1e9 if nbytes else None, "timed_as": how}
        rows.append(row)
    # the residual adds after the FFN (cupy elementwise, outside the backend): one a layer, except where moe_combine
    # added it (the attention half's add is add_rms_norm's)
    n_adds = eng.config.n_layer - sum(fused_res)
    if n_adds:
        x = cupy.ones((1, eng.config.n_embd), dtype=cupy.float32)
        t_add, how = time_graph([lambda: x + x] * 16, reps=5)
        rows.append({"op": "add (residual, cupy)", "calls": n_adds, "us_per_call": 1e6 * t_add,
                     "us_per_token": 1e6 * t_add * n_adds, "GBps": None, "timed_as": how})
    rows.sort(key=lambda r: -r["us_per_token"])
    cfg = eng.config
    used = cfg.n_expert_used / cfg.n_expert if cfg.n_expert else 1.0  # of a 3-D expert tensor, a token reads this
    w_bytes = sum(int(w.raw.nbytes * (used if w.raw.ndim == 3 else 1)) for lw in eng.weights.layers
                  for w in lw.values())
    w_bytes += int(eng.weights.output.raw.nbytes) + int(eng.weights.output_norm.raw.nbytes)
    rate = copy_rate()
    sum_ops = sum(r["us_per_token"] for r in rows) / 1e6
    n_launch = sum(r["calls"] for r in rows)
    summary = {
        "model": str(args.model), "depth": args.depth, "kv": f"{args.ctk}/{args.ctv}",
        "wall_ms_per_token": 1e3 * wall_s, "tg_tps": 1 / wall_s,
        "graph_gpu_ms_per_token": 1e3 * graph_s, "graph_tps": 1 / graph_s,
        "sum_of_ops_ms": 1e3 * sum_ops, "backend_ops_per_token": n_launch,
        "host_overhead_ms": 1e3 * (wall_s - graph_s),
        "weight_bytes_a_token": w_bytes, "d2d_copy_GBps": rate / 1e9,
        "bandwidth_limit_ms": 1e3 * w_bytes / rate, "bandwidth_limit_tps": rate / w_bytes,
        "graph_report": gpu.graph_report(),
    }
    print(f"\n=== decode profile: {args.model.name}, depth {args.depth}, KV {args.ctk}/{args.ctv}")
    print(f"{'op':44s} {'calls':>5s} {'us/call':>8s} {'us/token':>9s} {'GB/s':>7s}")
    for r in rows:
        gb = f"{r['GBps']:7.0f}" if r["GBps"] else "       "
        print(f"{r['op'][:44]:44s} {r['calls']:5d} {r['us_per_call']:8.1f} {r['us_per_token']:9.1f} {gb}")
    for k, v in summary.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "ops": rows}, indent=1))
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
