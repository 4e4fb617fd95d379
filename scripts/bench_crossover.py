"""The matmul crossover: per weight type as prefill runs it (repacked where the CPU repacks), the integer dots against
the float32 GEMM on the same batch (kernels_cpu.matmul's gemm_from forces one path), at several token counts; the
demo model's matrices (Gemma 3 270M shapes) and Llama-1B shapes with random blocks. Best of --reps calls each,
the two paths alternated, --rounds times; prints ms and int/GEMM (below 1: the integer dots are faster).

usage: python scripts/bench_crossover.py [--tokens 32,64,128,256,512] [--reps 3] [--rounds 2] [--threads 2]
                                         [--only SUBSTRING ...]
"""

import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_matmul import random_weight  # noqa: E402
from kernels_cpu import legacy_x8, q4_k_x8, q8_0_x8  # noqa: E402
from kernels_cpu.matmul import gemm_min_tokens, matmul  # noqa: E402

REPACK = {"Q4_K": (q4_k_x8.repack, "Q4_K_X8"), "Q5_0": (legacy_x8.repack_q5_0, "Q5_0_X8"),
          "Q4_0": (legacy_x8.repack_q4_0, "Q4_0_X8"), "Q8_0": (q8_0_x8.repack, "Q8_0_X8")}
# (label, file type, n_out, n_in): each model's matrices by shape, in the type its Q4_K_M file gives them
MATRICES = [
    ("gemma270m ffn_gate/up", "Q5_0", 2048, 640), ("gemma270m attn_q", "Q5_0", 1024, 640),
    ("gemma270m attn_output", "Q4_K", 640, 1024), ("gemma270m ffn_down", "Q6_K", 640, 2048),
    ("gemma270m ffn_down", "Q4_K", 640, 2048), ("gemma270m attn_v", "Q8_0", 256, 640),
    ("llama1b ffn_gate/up", "Q4_K", 8192, 2048), ("llama1b ffn_down", "Q6_K", 2048, 8192),
    ("llama1b ffn_down", "Q4_K", 2048, 8192), ("llama1b attn_q/o", "Q4_K", 2048, 2048),
    ("llama1b attn_v", "Q6_K", 512, 2048), ("llama1b Q4_0 ffn_gate", "Q4_0", 8192, 2048),
    ("llama1b Q8_0 ffn_gate", "Q8_0", 8192, 2048),
]


def best_ms(w, type_name, x, out, gemm_from, reps):
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        matmul(w, type_name, x, out, gemm_from=gemm_from)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,64,128,256,512")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=[])
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    rng = np.random.default_rng(0)
    print(f"threads {numba.get_num_threads()}; ms int / GEMM (ratio), best of {args.reps}, per round")
    print(f"{'matrix':34s} {'type':8s} {'host x':>6s}" + "".join(f" | {t:>28d}" for t in tokens))
    for label, file_type, n_out, n_in in MATRICES:
        if args.only and not any(s in f"{label} {file_type}" for s in args.only):
            continue
        w = random_weight(file_type, n_out, n_in, rng)
        repack, name = REPACK.get(file_type, (None, file_type))
        if repack is not None:
            w = repack(w)
        for rnd in range(args.rounds):
            cells = []
            for n_tok in tokens:
                x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
                out = np.empty((n_tok, n_out), dtype=np.float32)
                matmul(w, name, x, out, gemm_from=1 << 30)  # compile / warm up both
                matmul(w, name, x, out, gemm_from=0)
                t_int = best_ms(w, name, x, out, 1 << 30, args.reps)
                t_gemm = best_ms(w, name, x, out, 0, args.reps)
                cells.append(f"{t_int:8.2f} / {t_gemm:8.2f} ({t_int / t_gemm:4.2f})")
            print(f"{label if rnd == 0 else '':34s} {name:8s} {gemm_min_tokens(name):6d}" + "".join(
                f" | {c:>28s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
