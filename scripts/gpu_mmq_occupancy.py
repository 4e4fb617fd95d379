"""The tensor-core products of 2-8 tokens (matvec_q8t's "mma" design, one group of 8 token columns) with the
one-tile entries built for MINB CTAs an SM (MMQ_MINB in matvec_mmq.cu: __launch_bounds__' register cap; 0: none;
the default 4), timed on Llama-8B Q4_K_M's matrices: GPU us a call for each MINB.

    python3 scripts/gpu_mmq_occupancy.py [--minb 0,4,5,6] [--tokens 4,8]

Timings are CUDA-graph replays over rotating copies of each weight (> the 50 MB L2), GPU time only, as
scripts/gpu_q8t_check.py's. The last line: a Llama-8B decode step's tensor-core products (calls x time) a MINB."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_matvec_check import SHAPES, rotating_copies  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minb", default="0,4,5,6")
    ap.add_argument("--tokens", default="4,8")
    a = ap.parse_args()
    import cupy

    import kernels_gpu.matmul as km
    from gpu_check import time_graph

    minbs = [int(m) for m in a.minb.split(",")]
    toks = [int(t) for t in a.tokens.split(",")]
    plain = km.get_kernel
    step = {(m, n): 0.0 for m in minbs for n in toks}
    print("| matrix | tokens | " + " | ".join(f"MINB {m} us" for m in minbs) + " |")
    print("|---|---|" + "---|" * len(minbs))
    for i, (name, n_out, n_in, calls) in enumerate(SHAPES):
        if km.q8t_config(name, n_out, 8)[0] != "mma":
            continue
        ws = rotating_copies(name, n_out, n_in, i)
        for n in toks:
            x = cupy.asarray(np.random.default_rng(i + n).standard_normal((n, n_in)).astype(np.float32))
            xq, xm = km.quantize_q8_1(x)
            y = cupy.empty((n, n_out), dtype=cupy.float32)
            cells = []
            for m in minbs:
                km.get_kernel = (lambda mod, k, d=(), m=m:
                                 plain(mod, k, tuple(d) + ((("MMQ_MINB", m),) if mod == "matvec_q8" else ())))
                try:
                    t = time_graph([lambda w=w: km.matvec_q8t(w, name, xq, xm, y, kernel="mma") for w in ws])[0]
                finally:
                    km.get_kernel = plain
                cells.append(f"{t * 1e6:.1f}")
                step[(m, n)] += calls * t
            print(f"| {name} {n_out}x{n_in} | {n} | " + " | ".join(cells) + " |", flush=True)
        del ws
        cupy.get_default_memory_pool().free_all_blocks()
    for n in toks:
        print(f"a step's tensor-core products at {n} tokens, ms: "
              + ", ".join(f"MINB {m} {step[(m, n)] * 1e3:.3f}" for m in minbs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
