#!/usr/bin/env python3
"""Where a prompt batch goes when experts stay in host memory: op offload (`-ngl 0`: every layer's weights streamed
to the GPU for the batch) or GPU layers with experts in RAM (`--n-cpu-moe N`).

    python3 scripts/offload_prefill_profile.py MODEL.gguf [-ngl 0 | --n-cpu-moe 24] [-n 512] [--reps 3]
        [--paths mma,dequant] [--top 20] [--moe-cache auto --warm-decode 64] [--vram-budget 12GiB] [--json OUT.json]

For each upload path (mma: the used experts copied into compact slots and run on the tensor cores,
kernels_gpu.moe_upload; dequant: each run of experts dequantized to fp16 for cuBLAS, kernels_gpu.moe.prefill), in
one process on one model: the batch's t/s over --reps evaluations (after one warm-up), the expert bytes uploaded a
batch, and the host functions that took the most time in one profiled evaluation (where the host waits for the GPU
shows as the call that synchronizes: cupy.asnumpy of the routing, or the last copy of the logits). With --moe-cache
(filled by --warm-decode tokens first), the mma path reads the cached experts from their slots.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("-ngl", "--n-gpu-layers", default="0")
    ap.add_argument("--n-cpu-moe", "-ncmoe", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=0)
    ap.add_argument("-n", type=int, default=512, help="tokens of the batch")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--paths", default="mma,dequant")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--moe-cache", default="0", help="--moe-cache (its slots stand in for uploads)")
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--warm-decode", type=int, default=0, help="decode this many tokens first (fills the cache)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from hybrid.engine import Engine, EngineParams
    from hybrid.plan.overrides import build_overrides
    from hybrid.system.sizes import parse_size
    from kernels_gpu import moe_upload

    ngl = args.n_gpu_layers if args.n_gpu_layers in ("all", "auto") else int(args.n_gpu_layers)
    params = EngineParams(n_ctx=max(1024, 2 * args.n), n_batch=args.n, n_ubatch=args.n, n_gpu_layers=ngl,
                          n_threads=args.threads, overrides=build_overrides(n_cpu_moe=args.n_cpu_moe), op_offload=True,
                          moe_cache=args.moe_cache,
                          vram_budget=parse_size(args.vram_budget) if args.vram_budget else None)
    eng = Engine.load(args.model, params)
    gpus = [b for b in [*eng.backends, eng.output_backend] if hasattr(b, "host_experts")]
    gpu = gpus[0] if gpus else eng.op_offload.gpu  # -ngl 0: op offload's own GpuBackend
    he = gpu.host_experts
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, eng.config.n_vocab, args.n)
    if args.warm_decode:  # decode steps admit experts into the cache (prompt batches never do)
        cache = eng.new_cache()
        tok = int(tokens[0])
        for _ in range(args.warm_decode):
            tok = int(np.argmax(eng.eval([tok], cache)[-1]))
    why_not = moe_upload.why_not
    summary: dict = {"model": str(args.model), "ngl": args.n_gpu_layers, "n_cpu_moe": args.n_cpu_moe, "n": args.n}
    for path in args.paths.split(","):
        moe_upload.why_not = why_not if path == "mma" else (lambda *a: "off for this profile")
        eng.eval(tokens, eng.new_cache())  # warm-up: compiles, allocates, page-locks
        before = he.stats.uploaded_bytes
        times = []
        for _ in range(args.reps):
            cache = eng.new_cache()
            t0 = time.perf_counter()
            eng.eval(tokens, cache)
            times.append(time.perf_counter() - t0)
        uploaded = (he.stats.uploaded_bytes - before) / args.reps
        prof = cProfile.Profile()
        cache = eng.new_cache()
        prof.enable()
        eng.eval(tokens, cache)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        best = min(times)
        summary[path] = {"pp_tps_best": args.n / best, "pp_tps_each": [args.n / t for t in times],
                         "expert_gib_a_batch": uploaded / 2**30}
        print(f"== {path}: pp{args.n} {args.n / best:.1f} t/s (each: "
              f"{', '.join(f'{args.n / t:.1f}' for t in times)}), experts uploaded {uploaded / 2**30:.2f} GiB a batch")
        print("\n".join(out.getvalue().splitlines()[:args.top + 12]))
    moe_upload.why_not = why_not
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
