"""The GPU's tensor-core products of 9-64 rows (matmul_mmq: a prompt chunk beside decoding sequences), timed on
Llama-8B Q4_K_M's matrices: GPU us and GB/s of weight bytes for every split of a row tile (wpr) and 1 or 2 row tiles a
warp (rt).

    python3 scripts/gpu_mmq_check.py [--tokens 16,32,64]

Timings are CUDA-graph replays over rotating copies of each weight (> the 50 MB L2), GPU time only. The last lines:
the products of a Llama-8B step of that many rows (calls x time) with the default configuration and with the best
of the sweep for each matrix."""

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
    ap.add_argument("--tokens", default="16,32,64")
    a = ap.parse_args()
    import cupy

    from gpu_check import time_graph
    from kernels_gpu.matmul import MMQ_WPR, matmul_mmq, mmq_rt, quantize_q8_1

    toks = [int(t) for t in a.tokens.split(",")]
    step = {n: [0.0, 0.0] for n in toks}  # a Llama-8B step's products: default, best of the sweep
    picks = []
    for i, (name, n_out, n_in, calls) in enumerate(SHAPES):
        ws = rotating_copies(name, n_out, n_in, i)
        w1 = ws[0]
        mb = w1.nbytes / 1e6
        print(f"\n{name} {n_out}x{n_in} ({mb:.1f} MB)", flush=True)
        for n in toks:
            x = cupy.asarray(np.random.default_rng(i + n).standard_normal((n, n_in)).astype(np.float32))
            xq, xm = quantize_q8_1(x)
            y = cupy.empty((n, n_out), dtype=cupy.float32)
            cells, best = [], (1e9, "")
            t_def = time_graph([lambda w=w: matmul_mmq(w, name, xq, xm, y) for w in ws])[0]
            for rt in (1, 2):
                for wpr in (1, 2, 4, 8):
                    t = time_graph([lambda w=w: matmul_mmq(w, name, xq, xm, y, wpr=wpr, rt=rt) for w in ws])[0]
                    cells.append(f"r{rt}w{wpr}:{t * 1e6:.1f}")
                    best = min(best, (t, f"rt {rt} wpr {wpr}"))
            print(f"  {n} tokens: default (rt {mmq_rt(n_out, n)}, wpr {MMQ_WPR}) {t_def * 1e6:.1f} us "
                  f"({mb / t_def / 1e3:.0f} GB/s);"
                  f" best {best[1]} {best[0] * 1e6:.1f} us ({mb / best[0] / 1e3:.0f} GB/s)"
                  f"\n    us: {' '.join(cells)}", flush=True)
            picks.append(f"{name} {n_out}x{n_in} n={n}: {best[1]}")
            step[n][0] += calls * t_def
            step[n][1] += calls * best[0]
        del ws, w1
        cupy.get_default_memory_pool().free_all_blocks()
    print("\nbest a matrix:\n  " + "\n  ".join(picks))
    print("\nLlama-8B Q4_K_M step of N rows, quantized products only (calls x time):")
    for n in toks:
        print(f"  N={n}: default {step[n][0] * 1e3:.2f} ms | best of the sweep {step[n][1] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
