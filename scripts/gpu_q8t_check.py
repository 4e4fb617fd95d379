"""The GPU's q8 matvec of 2-8 tokens (matvec_q8t: a decode batch of several sequences), timed on Llama-8B Q4_K_M's
matrices: GB/s of weight bytes next to the one-token kernel, and a sweep of both designs (dp4a, tensor cores) x rows
a warp x warps a row group.

    python3 scripts/gpu_q8t_check.py [--tokens 2,4,8]

Timings are CUDA-graph replays over rotating copies of each weight (> the 50 MB L2), GPU time only (as
scripts/gpu_matvec_check.py). The last lines: a Llama-8B decode step's quantized matvecs with the default
configuration and with the best of the sweep for each matrix."""

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


def configs(name: str):
    """(label, kernel, rpw, wpr) of every design that takes this type."""
    from kernels_gpu.matmul import Q8T_MMA_TYPES

    out = [(f"dp4a-r{r}w{w}", "dp4a", r, w) for r in (2, 4) for w in (1, 2, 4)]
    if name in Q8T_MMA_TYPES:
        out += [(f"mma-w{w}", "mma", None, w) for w in (2, 4, 8)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2,4,8")
    a = ap.parse_args()
    import cupy

    from gpu_check import time_graph
    from kernels_gpu.matmul import matvec_q8, matvec_q8t, q8t_config, quantize_q8_1

    toks = [int(t) for t in a.tokens.split(",")]
    step = {n: [0.0, 0.0, 0.0] for n in toks}  # a Llama-8B step: one-token kernel x n, default, best of the sweep
    picks = []
    for i, (name, n_out, n_in, calls) in enumerate(SHAPES):
        ws = rotating_copies(name, n_out, n_in, i)
        w1 = ws[0]
        mb = w1.nbytes / 1e6
        x1 = cupy.asarray(np.random.default_rng(i).standard_normal((1, n_in)).astype(np.float32))
        xq1, xm1 = quantize_q8_1(x1)
        y1 = cupy.empty((1, n_out), dtype=cupy.float32)
        t1 = time_graph([lambda w=w: matvec_q8(w, name, xq1, xm1, y1) for w in ws])[0]
        print(f"\n{name} {n_out}x{n_in} ({mb:.1f} MB): one token {t1 * 1e6:.1f} us ({mb / t1 / 1e3:.0f} GB/s)",
              flush=True)
        for n in toks:
            x = cupy.asarray(np.random.default_rng(i + n).standard_normal((n, n_in)).astype(np.float32))
            xq, xm = quantize_q8_1(x)
            y = cupy.empty((n, n_out), dtype=cupy.float32)
            t_def = time_graph([lambda w=w: matvec_q8t(w, name, xq, xm, y) for w in ws])[0]
            cells, best = [], (1e9, "")
            for label, kernel, rpw, wpr in configs(name):
                t = time_graph([lambda w=w: matvec_q8t(w, name, xq, xm, y, wpr=wpr, rpw=rpw, kernel=kernel)
                                for w in ws])[0]
                cells.append(f"{label}:{mb / t / 1e3:.0f}")
                best = min(best, (t, label))
            k, r, w = q8t_config(name, n_out, n)
            print(f"  {n} tokens: default {k}-r{r}w{w} {t_def * 1e6:7.1f} us ({mb / t_def / 1e3:4.0f} GB/s, "
                  f"{t_def / t1:.2f}x one token); best {best[1]} {best[0] * 1e6:.1f} us ({mb / best[0] / 1e3:.0f} GB/s)"
                  f"\n    GB/s: {' '.join(cells)}", flush=True)
            picks.append(f"{name} {n_out}x{n_in} n={n}: {best[1]}")
            step[n][0] += calls * t1 * n
            step[n][1] += calls * t_def
            step[n][2] += calls * best[0]
        del ws, w1
        cupy.get_default_memory_pool().free_all_blocks()
    print("\nbest a matrix:\n  " + "\n  ".join(picks))
    print("\nLlama-8B Q4_K_M decode step, quantized matvecs only (calls x time):")
    for n in toks:
        one, t_def, t_best = step[n]
        print(f"  B={n}: one-token kernel x {n} {one * 1e3:.2f} ms | default {t_def * 1e3:.2f} ms | "
              f"best of the sweep {t_best * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
