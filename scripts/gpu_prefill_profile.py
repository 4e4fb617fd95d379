#!/usr/bin/env python3
"""Where the time of one prefill micro-batch goes on the GPU (all layers offloaded).

    python3 scripts/gpu_prefill_profile.py MODEL.gguf [-p 512] [--json OUT.json]

Runs the batch once to warm up, then once with every GpuBackend op bracketed by device synchronizations, so
each op's time is its own (the sum exceeds the unbracketed batch by the launch gaps the brackets expose); the
matmuls are split by weight type and shape, with TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPS = ("matmul", "matmuls", "get_rows", "rms_norm", "add_rms_norm", "rms_norm_heads", "rope", "scale", "glu", "kv_store",
       "attention", "from_host", "to_host", "fused_moe")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("--json")
    a = ap.parse_args()

    import cupy

    from hybrid.backends.gpu import GpuBackend
    from hybrid.engine import Engine, EngineParams

    eng = Engine.load(a.model, EngineParams(n_ctx=a.p + 16, n_batch=a.p, n_ubatch=a.p, n_gpu_layers="all"))
    toks = [(7 * i + 3) % eng.config.n_vocab for i in range(a.p)]
    sync = cupy.cuda.runtime.deviceSynchronize
    eng.eval(toks, eng.new_cache())  # warm-up: compiles, fills the pools
    sync()
    t0 = time.perf_counter()
    eng.eval(toks, eng.new_cache())
    sync()
    batch_ms = 1000 * (time.perf_counter() - t0)

    times: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    flops: dict[str, float] = defaultdict(float)

    def wrap(name, fn):
        def timed(self, *args, **kw):
            sync()
            t = time.perf_counter()
            out = fn(self, *args, **kw)
            sync()
            dt = time.perf_counter() - t
            key = name
            if name == "matmul":
                w, x = args[0], args[1]
                key = f"matmul {w.type_name} {w.shape[0]}x{w.shape[1]}"
                flops[key] += 2.0 * w.shape[0] * w.shape[1] * x.shape[0]
            elif name == "matmuls":  # e.g. "matmuls Q4_K 4096+1024+1024x4096" (types joined by / when mixed)
                ws, x = args[0], args[1]
                types = "/".join(dict.fromkeys(w.type_name for w in ws))
                key = f"matmuls {types} {'+'.join(str(w.shape[0]) for w in ws)}x{ws[0].shape[1]}"
                flops[key] += 2.0 * sum(w.shape[0] for w in ws) * ws[0].shape[1] * x.shape[0]
            times[key] += dt
            calls[key] += 1
            return out
        return timed

    for op in OPS:
        setattr(GpuBackend, op, wrap(op, getattr(GpuBackend, op)))
    eng.eval(toks, eng.new_cache())
    total = 1000 * sum(times.values())
    print(f"pp{a.p}: one batch {batch_ms:.1f} ms ({a.p / batch_ms * 1000:.0f} t/s) unbracketed; "
          f"bracketed ops sum {total:.1f} ms")
    print(f"{'op':40s} {'calls':>6s} {'ms/call':>9s} {'ms':>9s} {'TFLOP/s':>8s}")
    rows = []
    for k in sorted(times, key=times.get, reverse=True):
        ms = 1000 * times[k]
        tf = flops[k] / times[k] / 1e12 if flops.get(k) else None
        print(f"{k:40s} {calls[k]:6d} {ms / calls[k]:9.3f} {ms:9.2f} {'' if tf is None else f'{tf:8.1f}'}")
        rows.append({"op": k, "calls": calls[k], "ms": ms, "tflops": tf})
    if a.json:
        Path(a.json).write_text(json.dumps({"batch_ms": batch_ms, "ops": rows}, indent=1))


if __name__ == "__main__":
    main()
