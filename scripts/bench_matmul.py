"""Benchmark the CPU matmul kernels: per GGML type, a matvec (1 token: weight GB/s) and batched products
(GFLOP/s = 2 * n_out * n_in * n_tok / s) on an n x n weight, best of several runs; with --baseline, the
pre-SIMD kernels (tests/reference: quant_dot_legacy, quant_dot_k, float decode + dot per row) in the same run.

usage: python scripts/bench_matmul.py [TYPE ...] [--n 2048] [--rows N] [--tokens 64,512] [--reps 10]
                                      [--threads T] [--baseline]
"""

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# tests/reference by the name the tests import it under, `reference`: Numba's on-disk cache records module names
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kernels_cpu.matmul import KERNELS, matmul  # noqa: E402
from reference import BASELINE_TYPES, matmul_baseline  # noqa: E402

# Byte offsets of the fp16 scale fields in each block (random bytes there would give inf/NaN scales).
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
                "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
                "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,)}


def random_weight(type_name, n_out, n_in, rng):
    k = KERNELS[type_name]
    if type_name in ("F32", "F16", "BF16"):
        vals = rng.standard_normal((n_out, n_in)).astype(np.float32)
        if type_name == "F32":
            return vals.view(np.uint8)
        if type_name == "F16":
            return vals.astype(np.float16).view(np.uint8)
        return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = n_in // k.block_size
    w = rng.integers(0, 256, size=(n_out, nb, k.type_size), dtype=np.uint8)
    for off in SCALE_FIELDS.get(type_name, ()):
        w[:, :, off:off + 2] = rng.uniform(0.01, 0.1, (n_out, nb, 1)).astype(np.float16).view(np.uint8)
    if type_name == "MXFP4":  # e8m0 scale 2**(e - 128)
        w[:, :, 0] = rng.integers(120, 125, (n_out, nb))
    elif type_name == "IQ1_M":  # the fp16 d in the top nibbles of the 4 u16 scales
        w[:, :, 48:56] &= np.array([255, 15] * 4, dtype=np.uint8)
        w[:, :, 55] |= 0x20  # d = 2**-7 (0x2000)
    return w.reshape(n_out, nb * k.type_size)


def old_matmul(w, type_name, x, y):
    """The kernels before the SIMD rewrite (None for types they did not cover differently)."""
    return matmul_baseline(w, type_name, x, y) if type_name in BASELINE_TYPES else None


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
    ap.add_argument("--n", type=int, default=2048, help="n_in (and n_out unless --rows)")
    ap.add_argument("--rows", type=int, default=0, help="n_out (default: n)")
    ap.add_argument("--tokens", default="64,512")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--baseline", action="store_true", help="also time the pre-SIMD kernels")
    args = ap.parse_args()
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    n_in, n_out = args.n, args.rows or args.n
    batches = [int(t) for t in args.tokens.split(",") if t]
    print(f"threads {numba.get_num_threads()}, weight {n_out} x {n_in}")
    head = f"{'type':8s} {'MB':>7s} | {'matvec ms':>9s} {'GB/s':>6s}" + "".join(f" | x{b:<4d} GFLOP/s" for b in batches)
    if args.baseline:
        head += " || old: matvec GB/s" + "".join(f" | x{b:<4d} GFLOP/s" for b in batches)
    print(head)
    for name in args.types:
        w = random_weight(name, n_out, n_in, rng)
        row, old = [], []
        for n_tok in [1] + batches:
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            y = np.empty((n_tok, n_out), dtype=np.float32)
            reps = args.reps if n_tok < 256 else max(2, args.reps // 4)
            dt = best_time(lambda: matmul(w, name, x, out=y), reps)
            row.append((dt, w.nbytes / dt / 1e9, 2.0 * n_out * n_in * n_tok / dt / 1e9))
            if args.baseline and old_matmul(w, name, x, y) is not None:
                dt = best_time(lambda: old_matmul(w, name, x, y), reps)
                old.append((dt, w.nbytes / dt / 1e9, 2.0 * n_out * n_in * n_tok / dt / 1e9))
        line = f"{name:8s} {w.nbytes / 1e6:7.2f} | {row[0][0] * 1e3:9.3f} {row[0][1]:6.2f}"
        line += "".join(f" | {r[2]:12.1f}" for r in row[1:])
        if old:
            line += f" || {old[0][1]:18.2f}" + "".join(f" | {r[2]:12.1f}" for r in old[1:])
        print(line)


if __name__ == "__main__":
    main()
