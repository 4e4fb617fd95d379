"""Benchmark the CPU matmul kernels: per GGML type, a matvec (1 token) and a 64-token matmul on a 2048x2048
weight; prints weight GB/s and GFLOP/s (2 * n_out * n_in * n_tok flops), best of several runs.

usage: python scripts/bench_matmul.py [TYPE ...] [--n 2048] [--tokens 64] [--reps 10]
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_cpu.matmul import KERNELS, matmul  # noqa: E402

# Byte offsets of the fp16 scale fields in each block (random bytes there would give inf/NaN scales).
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
                "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}


def random_weight(type_name, n_out, n_in, rng):
    k = KERNELS[type_name]
    nb = n_in // k.block_size
    w = rng.integers(0, 256, size=(n_out, nb, k.type_size), dtype=np.uint8)
    if type_name in ("F32", "F16", "BF16"):
        vals = rng.standard_normal((n_out, n_in)).astype(np.float32)
        if type_name == "F32":
            return vals.view(np.uint8)
        if type_name == "F16":
            return vals.astype(np.float16).view(np.uint8)
        return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    for off in SCALE_FIELDS[type_name]:
        w[:, :, off:off + 2] = rng.uniform(0.01, 0.1, (n_out, nb, 1)).astype(np.float16).view(np.uint8)
    return w.reshape(n_out, nb * k.type_size)


def best_time(fn, reps):
    fn()  # compile / warm up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("types", nargs="*", default=list(KERNELS))
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n = args.n
    print(f"{'type':8s} {'MB':>6s} | {'matvec ms':>9s} {'GB/s':>6s} {'GFLOP/s':>7s} | "
          f"{'x' + str(args.tokens) + ' ms':>9s} {'GB/s':>6s} {'GFLOP/s':>7s}")
    for name in args.types:
        w = random_weight(name, n, n, rng)
        row = []
        for n_tok in (1, args.tokens):
            x = rng.standard_normal((n_tok, n)).astype(np.float32)
            y = np.empty((n_tok, n), dtype=np.float32)
            dt = best_time(lambda: matmul(w, name, x, out=y), args.reps)
            row += [dt * 1e3, w.nbytes / dt / 1e9, 2.0 * n * n * n_tok / dt / 1e9]
        print(f"{name:8s} {w.nbytes / 1e6:6.2f} | {row[0]:9.3f} {row[1]:6.2f} {row[2]:7.2f} | "
              f"{row[3]:9.3f} {row[4]:6.2f} {row[5]:7.2f}")


if __name__ == "__main__":
    main()
