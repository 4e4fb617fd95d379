"""Plain vs repacked (8-row interleaved) integer dots, one token, alternating in one process, for docs/BENCHMARKS.md.

    python3 scripts/bench_repack.py [--types Q4_K,Q5_0,Q4_0] [--rows N] [--cols N] [--reps R] [-t 1,2] [--rounds 9]

Random blocks of each type (sane scales), the plain rows and their repacked copy (hybrid/repack.py's layouts);
every thread takes a static share of whole 8-row groups and runs it `--reps` times inside one compiled call, so
no Python runs between rows. Prints GB/s of the plain type's bytes (the repacked Q4_K is 2.8% larger), the
median of --rounds alternating rounds after one warm-up each. A small matrix (e.g. --rows 256 --cols 2048
--reps 400) measures the kernels from the caches, a large one (--rows 49152 --cols 2048 --reps 2) from memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.backends.repack import LAYOUTS  # noqa: E402
from kernels_cpu import act_quant, vec_dot_k, vec_dot_legacy  # noqa: E402
from kernels_cpu.matmul import KERNELS, REPACKED  # noqa: E402


@njit(parallel=True)
def _k_rows(kind, w, xq, xd, bs, y, nt, reps):
    n_out, rb = w.shape
    wf = w.reshape(w.size)
    for t in prange(nt):
        for _ in range(reps):
            vec_dot_k.rows_dot(kind, wf, rb, t * n_out // nt // 8 * 8, (t + 1) * n_out // nt // 8 * 8,
                               xq[0], xd[0], bs[0], y[0], xq.shape[1] // 256)


@njit(parallel=True)
def _legacy_rows(kind, w, xq, xd, xs, y, nt, reps):
    n_out, rb = w.shape
    wf = w.reshape(w.size)
    for t in prange(nt):
        for _ in range(reps):
            vec_dot_legacy.rows_dot(kind, wf, rb, t * n_out // nt // 8 * 8, (t + 1) * n_out // nt // 8 * 8,
                                    xq[0], xd[0], xs[0], y[0], xq.shape[1] // 32)


def _random_rows(name: str, n_out: int, n_in: int, rng) -> np.ndarray:
    k = KERNELS[name]
    nb = n_in // k.block_size
    w = rng.integers(0, 256, size=(n_out, nb, k.type_size), dtype=np.uint8)
    fp16_fields = {"Q4_K": (0, 2), "Q5_0": (0,), "Q4_0": (0,)}[name]
    for off in fp16_fields:
        w[:, :, off:off + 2] = rng.uniform(-0.05, 0.05, (n_out, nb, 1)).astype("<f2").view(np.uint8)
    return w.reshape(n_out, nb * k.type_size)


def _runner(name: str, n_in: int, rng):
    """(run(w, kind, nt, reps), plain kind, repacked kind) for one type on a random token."""
    x = rng.standard_normal((1, n_in)).astype(np.float32)
    layout = LAYOUTS[name][0]
    if KERNELS[name].vec_dot_type == "Q8_K":
        xq, xd, bs = act_quant.quantize_q8_k(x)
        return (lambda w, kind, y, nt, reps: _k_rows(kind, w, xq, xd, bs, y, nt, reps),
                getattr(vec_dot_k, name), getattr(vec_dot_k, layout))
    xq, xd = act_quant.quantize_q8_0(x)
    xs = np.zeros((1, n_in // 32), dtype=np.float32)
    return (lambda w, kind, y, nt, reps: _legacy_rows(kind, w, xq, xd, xs, y, nt, reps),
            getattr(vec_dot_legacy, name), getattr(vec_dot_legacy, layout))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q5_0,Q4_0")
    ap.add_argument("--rows", type=int, default=49152)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| type | shape | threads | plain GB/s | repacked GB/s | ratio |\n|---|---|---|---|---|---|")
    for name in a.types.split(","):
        w = _random_rows(name, a.rows, a.cols, rng)
        layout, _, repack = LAYOUTS[name]
        rp = repack(w)
        assert REPACKED[layout].row_group == 8
        run, kind, rkind = _runner(name, a.cols, rng)
        y = np.empty((1, a.rows), dtype=np.float32)
        for nt in (int(t) for t in a.threads.split(",")):
            numba.set_num_threads(nt)
            times: dict[str, list[float]] = {"plain": [], "repacked": []}
            for _ in range(a.rounds + 1):
                for label, arr, k in (("plain", w, kind), ("repacked", rp, rkind)):
                    t0 = time.perf_counter()
                    run(arr, k, y, nt, a.reps)
                    times[label].append(time.perf_counter() - t0)
            gb = w.nbytes * a.reps / 1e9
            plain, packed = (gb / float(np.median(times[k][1:])) for k in ("plain", "repacked"))
            print(f"| {name} | {a.rows} x {a.cols} | {nt} | {plain:.1f} | {packed:.1f} | {packed / plain:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
